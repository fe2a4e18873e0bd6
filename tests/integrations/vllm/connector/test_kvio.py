"""The vLLM connector's worker side (`connector.kvio`): paged KV <-> a real BlockStore."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dualpath.core.blocks import block_keys
from dualpath.core.store import HEADER_BYTES, BlockStore
from dualpath.integrations.vllm.connector.kvio import KVWorker, LayoutError
from dualpath.integrations.vllm.connector.plan import BlockTransfer, StepPlan

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn",
          "model.layers.2.self_attn.attn"]
NUM_BLOCKS, HEADS, BS, CH = 8, 2, 4, 6  # vLLM CPU: [blocks, kv heads, block size, 2 * head]
PAGE_BYTES = HEADS * BS * CH * 4
KEYS = block_keys(list(range(5 * BS)), BS)


def paged(seed: int | None = None) -> dict[str, torch.Tensor]:
    """One paged KV tensor per layer, random (seeded) or zeros."""
    if seed is None:
        return {n: torch.zeros(NUM_BLOCKS, HEADS, BS, CH) for n in LAYERS}
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(NUM_BLOCKS, HEADS, BS, CH, generator=g) for n in LAYERS}


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
    dst = {n: torch.zeros(HEADS, NUM_BLOCKS, BS, CH).permute(1, 0, 2, 3) for n in LAYERS}
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
