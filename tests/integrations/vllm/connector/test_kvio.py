"""The vLLM connector's worker side (`connector.kvio`): paged KV <-> a real BlockStore."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dualpath.core.blocks import block_keys
from dualpath.integrations.vllm.connector.kvio import KVWorker
from dualpath.integrations.vllm.connector.pages import LayoutError, paged_kv_bases
from dualpath.integrations.vllm.connector.step_plan import BlockTransfer, StepPlan
from dualpath.integrations.vllm.manifest import Shard
from dualpath.store import HEADER_BYTES, BlockStore

KV_DEVICE = torch.device(os.environ.get("DUALPATH_TEST_DEVICE", "cpu"))  # conftest.py
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn",
          "model.layers.2.self_attn.attn"]
NUM_BLOCKS, HEADS, BS, CH = 8, 2, 4, 6  # vLLM CPU: [blocks, kv heads, block size, 2 * head]
PAGE_BYTES = HEADS * BS * CH * 4
KEYS = block_keys(list(range(5 * BS)), BS)


def paged(seed: int | None = None) -> dict[str, torch.Tensor]:
    """One paged KV tensor per layer, random (seeded) or zeros."""
    if seed is None:
        return {n: torch.zeros(NUM_BLOCKS, HEADS, BS, CH, device=KV_DEVICE) for n in LAYERS}
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(NUM_BLOCKS, HEADS, BS, CH, generator=g).to(KV_DEVICE)
            for n in LAYERS}


def make(tmp_path: Path) -> KVWorker:
    store = BlockStore(tmp_path / "store", len(LAYERS) * PAGE_BYTES, is_durable=False)
    return KVWorker(store, LAYERS, PAGE_BYTES, event_log=tmp_path / "events.jsonl")


def save_step(worker: KVWorker, kv: dict[str, torch.Tensor], *transfers: BlockTransfer) -> None:
    worker.bind(StepPlan(saves=list(transfers)))
    worker.load()
    for name in LAYERS:  # vLLM's order: each layer's attention, then save_kv_layer
        worker.capture(name, kv[name])
    worker.flush()


def load_step(worker: KVWorker, kv: dict[str, torch.Tensor], *transfers: BlockTransfer,
              saves: tuple[BlockTransfer, ...] = ()) -> set[int]:
    worker.bind(StepPlan(loads=list(transfers), saves=list(saves)))
    worker.load()
    for name in LAYERS:
        worker.inject(name, kv[name])
        worker.capture(name, kv[name])
    worker.flush()
    return worker.take_load_errors()


def test_saved_blocks_load_back_into_other_block_ids(tmp_path: Path) -> None:
    worker = make(tmp_path)
    src = paged(0)
    save_step(worker, src, BlockTransfer("a", 0, (5, 2), tuple(KEYS[:2])))
    assert worker.counters.saved_blocks == 2 and len(worker.store.keys()) == 2
    dst = paged()
    assert load_step(worker, dst, BlockTransfer("b", 0, (1, 6), tuple(KEYS[:2]))) == set()
    for name in LAYERS:
        assert torch.equal(dst[name][1], src[name][5])
        assert torch.equal(dst[name][6], src[name][2])
        assert not dst[name][[0, 2, 3, 4, 5, 7]].any()  # nothing else written
    assert worker.counters.loaded_blocks == 2


def test_the_payload_does_not_depend_on_the_physical_stride_order(tmp_path: Path) -> None:
    """A logical [B, H, N, C] view of an [H, B, N, C] tensor stores the same bytes."""
    worker = make(tmp_path)
    src = paged(1)
    save_step(worker, src, BlockTransfer("a", 0, (3,), (KEYS[0],)))
    permuted = {n: t.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)
                for n, t in src.items()}
    assert not permuted[LAYERS[0]].is_contiguous()
    other = make(tmp_path / "other")
    save_step(other, permuted, BlockTransfer("a", 0, (3,), (KEYS[0],)))
    a = worker.store.path_of(KEYS[0]).read_bytes()
    b = other.store.path_of(KEYS[0]).read_bytes()
    assert a == b
    dst = {n: torch.zeros(HEADS, NUM_BLOCKS, BS, CH, device=KV_DEVICE).permute(1, 0, 2, 3)
           for n in LAYERS}
    load_step(other, dst, BlockTransfer("b", 0, (4,), (KEYS[0],)))
    assert all(torch.equal(dst[n][4], src[n][3]) for n in LAYERS)


def test_stored_blocks_are_not_written_again(tmp_path: Path) -> None:
    worker = make(tmp_path)
    src = paged(2)
    save_step(worker, src, BlockTransfer("a", 0, (0, 1), tuple(KEYS[:2])))
    mtime = worker.store.path_of(KEYS[0]).stat().st_mtime_ns
    save_step(worker, paged(3), BlockTransfer("b", 0, (0, 1, 2), tuple(KEYS[:3])))
    assert worker.counters.saved_blocks == 3 and worker.counters.skipped_saves == 2
    assert worker.store.path_of(KEYS[0]).stat().st_mtime_ns == mtime


def test_a_corrupt_block_is_a_load_error_and_its_request_saves_nothing(tmp_path: Path) -> None:
    worker = make(tmp_path)
    src = paged(4)
    save_step(worker, src, BlockTransfer("a", 0, (0, 1, 2), tuple(KEYS[:3])))
    path = worker.store.path_of(KEYS[1])
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 7] ^= 0x01
    path.write_bytes(bytes(data))
    dst = paged()
    errors = load_step(
        worker, dst, BlockTransfer("b", 0, (4, 5, 6), tuple(KEYS[:3])),
        saves=(BlockTransfer("b", 0, (4, 5, 6, 7), tuple(KEYS[:4])),
               BlockTransfer("c", 0, (3,), (KEYS[4],))))
    assert errors == {5}
    assert worker.take_load_errors() == set()  # reported once
    assert all(torch.equal(dst[n][4], src[n][0]) for n in LAYERS)  # before the failure
    assert not any(dst[n][[5, 6]].any() for n in LAYERS)  # from the failure on: not loaded
    assert worker.store.counters.num_corrupt == 1 and not path.exists()
    # Request b's blocks are recomputed next step, so none was saved; request c's was.
    assert not worker.store.contains(KEYS[3]) and not worker.store.contains(KEYS[1])
    assert worker.store.contains(KEYS[4])
    assert worker.counters.load_errors == 1 and worker.counters.loaded_blocks == 1
    events = (tmp_path / "events.jsonl").read_text().splitlines()
    assert any('"error": true' in e for e in events)


def test_a_missing_block_is_a_load_error(tmp_path: Path) -> None:
    worker = make(tmp_path)
    assert load_step(worker, paged(), BlockTransfer("b", 2, (3,), (KEYS[2],))) == {3}


def test_a_page_of_another_size_is_refused(tmp_path: Path) -> None:
    worker = make(tmp_path)
    worker.bind(StepPlan(saves=[BlockTransfer("a", 0, (0,), (KEYS[0],))]))
    with pytest.raises(LayoutError, match="the store expects"):
        worker.capture(LAYERS[0], torch.zeros(NUM_BLOCKS, HEADS, BS, CH + 2))
    with pytest.raises(LayoutError, match="not one of"):
        worker.capture("model.layers.9.self_attn.attn", paged(0)[LAYERS[0]])
    with pytest.raises(LayoutError, match="store holds"):
        KVWorker(worker.store, LAYERS[:2], PAGE_BYTES)


def test_background_saves_land_and_are_counted(tmp_path: Path) -> None:
    """`background_saves`: the step hands its staged blocks to a writer thread (the pages were
    copied in capture, so the paged KV may change at once); `drain` waits for them."""
    store = BlockStore(tmp_path / "store", len(LAYERS) * PAGE_BYTES, is_durable=False)
    worker = KVWorker(store, LAYERS, PAGE_BYTES, background_saves=True, max_pending_saves=2)
    src = paged(3)
    expected = {n: t.clone() for n, t in src.items()}
    save_step(worker, src, BlockTransfer("a", 0, (5, 2), tuple(KEYS[:2])))
    for t in src.values():
        t.zero_()  # vLLM reuses the blocks: the saved bytes are the captured ones
    save_step(worker, paged(4), BlockTransfer("b", 2, (1,), (KEYS[2],)))  # waits: over 2
    save_step(worker, paged(5), BlockTransfer("a", 0, (5,), (KEYS[0],)))  # stored: skipped
    worker.drain()
    assert worker.counters.saved_blocks == 3 and worker.counters.skipped_saves == 1
    dst = paged()
    assert load_step(worker, dst, BlockTransfer("c", 0, (0, 7), tuple(KEYS[:2]))) == set()
    for name in LAYERS:
        assert torch.equal(dst[name][0], expected[name][5])
        assert torch.equal(dst[name][7], expected[name][2])
    worker.close()


def test_a_failed_background_save_is_counted_not_raised(tmp_path: Path) -> None:
    store = BlockStore(tmp_path / "store", len(LAYERS) * PAGE_BYTES, is_durable=False)
    worker = KVWorker(store, LAYERS, PAGE_BYTES, background_saves=True)

    def broken_put(*args: object, **kwargs: object) -> bool:
        raise OSError("disk full")

    store.put = broken_put  # type: ignore[method-assign]
    save_step(worker, paged(6), BlockTransfer("a", 0, (5,), (KEYS[0],)))
    worker.close()
    assert worker.counters.failed_saves == 1 and worker.counters.saved_blocks == 0


def test_two_tensor_parallel_ranks_on_one_store_each_get_their_own_shard_back(
        tmp_path: Path) -> None:
    """TP 2: each rank holds half of the KV heads and gets the same plan (rank-agnostic block
    keys); each writes and reads its own shard's files, so neither loads the other's heads
    (with one file per block key, the first writer won and the other rank got its heads)."""
    tp = 2
    g = torch.Generator().manual_seed(7)
    model_kv = {n: torch.randn(NUM_BLOCKS, HEADS * tp, BS, CH, generator=g).to(KV_DEVICE)
                for n in LAYERS}
    workers, ranks_kv = [], []
    for rank in range(tp):
        store = BlockStore(tmp_path / "store", len(LAYERS) * PAGE_BYTES, is_durable=False)
        workers.append(KVWorker(store, LAYERS, PAGE_BYTES, shard=Shard(rank, tp)))
        ranks_kv.append({n: t[:, rank * HEADS:(rank + 1) * HEADS].contiguous()
                         for n, t in model_kv.items()})
    for worker, kv in zip(workers, ranks_kv, strict=True):
        save_step(worker, kv, BlockTransfer("a", 0, (5, 2), tuple(KEYS[:2])))
    assert len(workers[0].store.keys()) == 2 * tp  # a file per block and rank
    assert not workers[0].store.contains(KEYS[0])  # none under the rank-agnostic key
    for rank, worker in enumerate(workers):
        dst = paged()
        assert load_step(worker, dst, BlockTransfer("b", 0, (1, 6), tuple(KEYS[:2]))) == set()
        for name in LAYERS:
            assert torch.equal(dst[name][1], ranks_kv[rank][name][5])
            assert torch.equal(dst[name][6], ranks_kv[rank][name][2])


def test_a_shard_missing_on_one_rank_is_that_ranks_load_error(tmp_path: Path) -> None:
    workers = [KVWorker(BlockStore(tmp_path / "store", len(LAYERS) * PAGE_BYTES,
                                   is_durable=False), LAYERS, PAGE_BYTES, shard=Shard(r, 2))
               for r in range(2)]
    save_step(workers[1], paged(8), BlockTransfer("a", 0, (0,), (KEYS[0],)))  # rank 0 did not
    assert load_step(workers[1], paged(), BlockTransfer("b", 0, (3,), (KEYS[0],))) == set()
    assert load_step(workers[0], paged(), BlockTransfer("b", 0, (3,), (KEYS[0],))) == {3}


# -- vLLM's KV cache layouts (0.32): one raw buffer, per-layer [B, H, N, C] views whose physical
# axis order is the layout's (LBNHC: vLLM's default for CUDA FlashAttention, which declares
# none; LBHNC: what the connector asks for; BLHNC: block-outermost). Shapes of a 70B dense GQA
# model's rank: 64 layers, 8 KV heads / TP, head dim 128 (K and V side by side), bf16, 16-token
# blocks.
LAYOUTS = {"LBNHC": (0, 1, 3, 2, 4), "LBHNC": (0, 1, 2, 3, 4), "BLHNC": (1, 0, 2, 3, 4)}
L70, H70, N16, C70 = 64, 8, 16, 2 * 128


def vllm_views(layout: str, num_layers: int, num_blocks: int, heads: int, tokens: int,
               content: int, seed: int | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The raw buffer and vLLM's per-layer views of it (the strides `create_kv_cache_views`
    gives: logical [L, B, H, N, C], physical order `LAYOUTS[layout]`)."""
    shape = (num_layers, num_blocks, heads, tokens, content)
    strides = [0] * 5
    step = 1
    for dim in reversed(LAYOUTS[layout]):
        strides[dim] = step
        step *= shape[dim]
    raw = torch.zeros(step, dtype=torch.bfloat16, device=KV_DEVICE)
    if seed is not None:
        raw.copy_(torch.randn(step, generator=torch.Generator().manual_seed(seed)))
    view = torch.as_strided(raw, shape, strides)
    return raw, {f"model.layers.{i}.self_attn.attn": view[i] for i in range(num_layers)}


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_flash_attention_layouts_of_a_70b_rank_copy_correctly(tmp_path: Path, tp: int) -> None:
    heads, num_blocks = H70 // tp, 3
    page = heads * N16 * C70 * 2
    _, src = vllm_views("LBNHC", L70, num_blocks, heads, N16, C70, seed=tp)
    names = list(src)
    store = BlockStore(tmp_path / "store", L70 * page, is_durable=False)
    worker = KVWorker(store, names, page)
    transfer = BlockTransfer("a", 0, (2, 0), tuple(block_keys(list(range(2 * N16)), N16)))
    worker.bind(StepPlan(saves=[transfer]))
    for name in names:
        worker.capture(name, src[name])
    worker.flush()
    assert worker.counters.saved_blocks == 2
    for layout in ("LBHNC", "BLHNC", "LBNHC"):
        _, dst = vllm_views(layout, L70, num_blocks, heads, N16, C70)
        worker.bind(StepPlan(loads=[BlockTransfer("b", 0, (1, 2), transfer.keys)]))
        worker.load()
        for name in names:
            worker.inject(name, dst[name])
        worker.flush()
        assert worker.take_load_errors() == set()
        for name in names:
            assert torch.equal(dst[name][1], src[name][2]), (layout, name)
            assert torch.equal(dst[name][2], src[name][0]), (layout, name)
            assert not dst[name][0].any()


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_raw_page_addresses_hold_the_logical_page(layout: str) -> None:
    """What NIXL moves: `page_bytes` at `address + block * block_stride_bytes`, which must be
    the page's bytes in logical [H, N, C] order (the store's payload)."""
    heads, num_blocks, num_layers = H70 // 2, 4, 3
    page = heads * N16 * C70 * 2
    raw, kv = vllm_views(layout, num_layers, num_blocks, heads, N16, C70, seed=3)
    flat = raw.view(torch.uint8)
    layers = paged_kv_bases(kv, list(kv), page)
    for (name, view), at in zip(kv.items(), layers, strict=True):
        assert at.block_stride_bytes == page * (num_layers if layout == "BLHNC" else 1)
        assert at.span.data_ptr() == at.address == view.data_ptr()
        for block in range(num_blocks):
            lo = at.address + block * at.block_stride_bytes - raw.data_ptr()
            assert torch.equal(flat[lo:lo + page], view[block].contiguous().view(torch.uint8)
                               .flatten()), (name, block)
        last = at.address + (num_blocks - 1) * at.block_stride_bytes + page
        assert at.span.data_ptr() + at.span.numel() * at.span.element_size() == last


def test_flash_attentions_default_layout_is_refused_for_raw_pages() -> None:
    """LBNHC stores a page token-major: its raw bytes are not the store's [H, N, C] payload,
    so a NIXL pull would put heads and tokens in the wrong places (the connector asks vLLM
    for LBHNC; this is the clear start-up error if it did not get it)."""
    heads = H70 // 2
    _, kv = vllm_views("LBNHC", 2, 3, heads, N16, C70)
    with pytest.raises(LayoutError, match="LBHNC"):
        paged_kv_bases(kv, list(kv), heads * N16 * C70 * 2)
    _, one_head = vllm_views("LBNHC", 2, 3, 1, N16, C70)  # TP 8: one head, the same bytes
    assert len(paged_kv_bases(one_head, list(one_head), N16 * C70 * 2)) == 2


def test_registered_host_kv_is_read_in_place_and_a_failure_still_stops_the_request(
        tmp_path: Path) -> None:
    """With vLLM's host KV registered, loads scatter each file's pages straight into the
    paged KV (no staging copy); a corrupt block is still that request's first load error."""
    worker = make(tmp_path)
    src = paged(9)
    save_step(worker, src, BlockTransfer("a", 0, (0, 1, 2), tuple(KEYS[:3])))
    dst = paged()
    worker.register(dst)
    assert load_step(worker, dst, BlockTransfer("b", 0, (4, 5, 6), tuple(KEYS[:3]))) == set()
    for name in LAYERS:
        assert torch.equal(dst[name][4:7], src[name][0:3])
    path = worker.store.path_of(KEYS[1])
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 3] ^= 0x10
    path.write_bytes(bytes(data))
    errors = load_step(worker, paged(), BlockTransfer("c", 0, (1, 2, 3), tuple(KEYS[:3])),
                       saves=(BlockTransfer("c", 0, (1, 2, 3, 7), tuple(KEYS[:4])),))
    assert errors == {2} and worker.counters.loaded_blocks == 3 + 1
    assert not worker.store.contains(KEYS[3])  # the failing request saved nothing


def test_a_step_reuses_its_staging_memory(tmp_path: Path) -> None:
    """Loads and saves take their staging from a pool: a second step of the same size
    allocates nothing new (no fresh pageable memory per block and step)."""
    worker = make(tmp_path)
    src = paged(10)
    save_step(worker, src, BlockTransfer("a", 0, (0, 1), tuple(KEYS[:2])))
    dst = paged()
    load_step(worker, dst, BlockTransfer("b", 0, (2, 3), tuple(KEYS[:2])))
    kept = {b.data_ptr() for b in worker._buffers._free}
    load_step(worker, dst, BlockTransfer("b", 0, (4, 5), tuple(KEYS[:2])))
    save_step(worker, src, BlockTransfer("c", 0, (0,), (KEYS[3],)))
    assert {b.data_ptr() for b in worker._buffers._free} == kept
    assert torch.equal(dst[LAYERS[2]][5], src[LAYERS[2]][1])
