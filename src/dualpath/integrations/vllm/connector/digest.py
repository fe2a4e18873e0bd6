"""The digest a prefill worker sends with each pushed Full Block, and the decode worker checks
its staging slot against: a stale or damaged slot is a load error there, never wrong KV.

Two kinds, told apart by value:
- host KV: the CRC32C of the block's pages in layer order (below 2**32), as the store's;
- GPU KV: a position-weighted sum of the block's 16-bit words, computed on the GPU where the
  pages are (one `index_select` per layer and one reduction; no copy to the host), with
  `SUM_TAG` set. Each word `x_k` (unsigned, k counting across the layers' pages) is weighted
  `(k mod 65521) + 1`, so a word moved, changed or missing changes the sum; products stay
  below 2**32 and a 32 MiB block's sum below 2**56, so the value is exact on any device.
"""

from __future__ import annotations

from collections.abc import Sequence

import crc32c
import torch

SUM_TAG = 1 << 62
"""Set in a word-sum digest (a CRC32C is below 2**32)."""
_MODULUS = 65521
_weights_cache: dict[tuple[int, int, str], torch.Tensor] = {}


def _weights(start: int, n: int, device: torch.device) -> torch.Tensor:
    key = (start, n, str(device))
    w = _weights_cache.get(key)
    if w is None:
        w = torch.arange(start, start + n, dtype=torch.int64, device=device) % _MODULUS + 1
        if len(_weights_cache) > 512:
            _weights_cache.clear()
        _weights_cache[key] = w
    return w


def _word_sum(words: torch.Tensor, start: int) -> torch.Tensor:
    """Per row of `words` (int16 [n, w]): sum of ((start + j) mod 65521 + 1) * unsigned word."""
    x = words.to(torch.int64) & 0xFFFF
    return (x * _weights(start, x.shape[1], x.device)).sum(dim=1)


def block_digests(layers: Sequence[torch.Tensor], block_ids: Sequence[int],
                  word_sum: bool | None = None) -> list[int]:
    """The digest of each block in `block_ids`: its pages across `layers` (vLLM's paged KV,
    one tensor per layer, block-outermost), in layer order. `word_sum`: the GPU kind (default:
    where the pages are on a GPU)."""
    if not block_ids:
        return []
    if word_sum is None:
        word_sum = any(layer.is_cuda for layer in layers)
    if not word_sum:
        out = []
        for block_id in block_ids:
            crc = 0
            for layer in layers:
                page = layer[block_id].cpu().contiguous().view(torch.uint8)
                crc = crc32c.crc32c(page.numpy().data, crc)
            out.append(crc)
        return out
    device = layers[0].device
    ids = torch.tensor(list(block_ids), device=device)
    total = torch.zeros(len(block_ids), dtype=torch.int64, device=device)
    start = 0
    for layer in layers:
        pages = layer.index_select(0, ids.to(layer.device)).reshape(len(block_ids), -1)
        words = pages.view(torch.uint8).view(torch.int16)
        total += _word_sum(words, start).to(device)
        start += words.shape[1]
    return [int(v) | SUM_TAG for v in total.tolist()]


def matches(block: torch.Tensor, digest: int) -> bool:
    """Whether `block` (uint8, a Full Block's bytes as pushed: pages in layer order) has
    `digest`, of either kind."""
    if digest & SUM_TAG:
        words = block.reshape(1, -1).view(torch.int16)
        return int(_word_sum(words, 0)[0]) == digest & ~SUM_TAG
    return bool(crc32c.crc32c(block.numpy().data) == digest)
