"""A layer's paged KV tensor as the connector moves it: where its pages lie in memory, for
raw-byte transfers (`paged_kv_bases`), and batched copies of pages in and out of it
(`scatter_pages`, `gather_pages`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


def wait_for_device(t: torch.Tensor) -> None:
    """Return once the work queued so far on the current stream of `t`'s GPU is done (a CUDA
    event recorded now, waited for); at once for a CPU tensor. Anything that reads `t`'s memory
    behind the stream's back (a NIXL WRITE, a copy on another stream) waits for this first."""
    if t.is_cuda:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(t.device))
        event.synchronize()


class LayoutError(ValueError):
    """A paged KV tensor does not match the layout the store was opened for."""


@dataclass(frozen=True)
class PagedLayer:
    """Where one layer's pages lie in memory, for transfers that move raw page bytes (NIXL)."""

    address: int
    """Of block 0's page."""
    block_stride_bytes: int
    """From one block's page to the next: the page itself in a layer-compact layout (LBHNC),
    every layer's page in a block-outermost one (BLHNC)."""
    span: torch.Tensor
    """A 1-D view from block 0's page to the end of the last (what NIXL registers)."""


def paged_kv_bases(kv_caches: Mapping[str, torch.Tensor], layer_names: Sequence[str],
                   page_bytes: int) -> list[PagedLayer]:
    """Each layer's pages for raw-byte transfers. The store's payload is a page in logical
    `[H, N, C]` order, so raw page bytes are only right where a page is stored that way: a
    dense run of `page_bytes` per block (any block stride). Layouts that store a page in
    another order (LBNHC, vLLM's default for CUDA FlashAttention: heads and tokens swapped)
    are refused; the connector asks vLLM for LBHNC (`get_required_kvcache_layout`)."""
    layers = []
    for name in layer_names:
        kv = kv_caches.get(name)
        if kv is None:
            raise LayoutError(f"vLLM registered no KV cache for layer {name!r}")
        size = kv.element_size()
        if kv.dim() < 2 or kv[0].numel() * size != page_bytes:
            raise LayoutError(f"layer {name!r}: paged KV {tuple(kv.shape)} {kv.dtype} does not "
                              f"hold {page_bytes} B pages")
        if not kv[0].is_contiguous():
            raise LayoutError(
                f"layer {name!r}: a page of the paged KV {tuple(kv.shape)} has strides "
                f"{kv.stride()[1:]}, not its logical [H, N, C] order (KV cache layout LBHNC); "
                "unset VLLM_KV_CACHE_LAYOUT or set it to LBHNC")
        stride = kv.stride(0) * size
        if kv.shape[0] > 1 and stride < page_bytes:
            raise LayoutError(f"layer {name!r}: blocks {stride} B apart overlap {page_bytes} "
                              f"B pages")
        span = (kv.shape[0] - 1) * kv.stride(0) + kv[0].numel()
        layers.append(PagedLayer(int(kv.data_ptr()), stride,
                                 torch.as_strided(kv, (span,), (1,))))
    return layers


def scatter_pages(kv: torch.Tensor, block_ids: torch.Tensor | Sequence[int],
                  pages: torch.Tensor, reuses_pages: bool = False) -> None:
    """`kv[block_ids[j]] = page j` for every row of `pages` (uint8 [n, page_bytes], any row
    stride). On a GPU one host-to-device copy and one `index_copy_`; on the host a `copy_`
    per page, a memcpy each (torch's CPU `index_copy_` is far slower). `reuses_pages`: the
    caller refills `pages` next, so the host-to-device copy is waited for."""
    n = pages.shape[0]
    src = pages.view(kv.dtype).view(n, *kv.shape[1:])
    if kv.is_cuda:
        ids = block_ids if isinstance(block_ids, torch.Tensor) else torch.tensor(
            list(block_ids), device=kv.device)
        kv.index_copy_(0, ids.to(kv.device), src.to(kv.device, non_blocking=not reuses_pages))
        return
    targets = block_ids.tolist() if isinstance(block_ids, torch.Tensor) else block_ids
    for j, block_id in enumerate(targets):
        kv[block_id].copy_(src[j])


def gather_pages(kv: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """`out[j] = kv[block_ids[j]]` (`out` uint8 [n, page_bytes], any row stride): on a GPU one
    `index_select` and one device-to-host copy (ordered after the kernels that wrote the
    pages: same stream), on the host a `copy_` per page."""
    n = out.shape[0]
    dst = out.view(kv.dtype).view(n, *kv.shape[1:])
    if kv.is_cuda:
        dst.copy_(kv.index_select(0, block_ids))
        return
    for j, block_id in enumerate(block_ids.tolist()):
        dst[j].copy_(kv[block_id])


