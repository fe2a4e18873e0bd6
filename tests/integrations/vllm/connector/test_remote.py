"""The DE read path's data plane without vLLM: a decode side (staging buffer, side channel,
NIXL agent) and a prefill side (paged KV registered with NIXL) in one process, real UCX
transfers, a real BlockStore.

Checks the bytes: DE-side hits staged from storage and pulled layer by layer into the prefill
worker's pages; the blocks the decode side lacks pushed into its staging buffer and loaded into
its own pages; every failure (a missing block, a dead side channel, an expired transfer) turns
into a load error (a recompute), never into wrong bytes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("nixl", reason="nixl (UCX) is part of make setup")

from dualpath.core.blocks import block_keys
from dualpath.integrations.vllm.cluster.ports import free_port
from dualpath.integrations.vllm.connector import staged_pull
from dualpath.integrations.vllm.connector.async_loader import AsyncLoader
from dualpath.integrations.vllm.connector.bounce import host_bounce_option
from dualpath.integrations.vllm.connector.decode_remote import DecodeRemote
from dualpath.integrations.vllm.connector.kvio import KVWorker
from dualpath.integrations.vllm.connector.remote import PrefillRemote
from dualpath.integrations.vllm.connector.side_channel.client import SideChannelClient
from dualpath.integrations.vllm.connector.side_channel.cpus import instance_cpus
from dualpath.integrations.vllm.connector.side_channel.service import spawn_side_channel
from dualpath.integrations.vllm.connector.side_channel.staging import StagingPool
from dualpath.integrations.vllm.connector.side_channel.tcp_server import DecodeSideChannel
from dualpath.integrations.vllm.connector.step_plan import (
    BlockTransfer,
    Push,
    RemoteLoad,
    StepPlan,
    XferLoad,
)
from dualpath.store import BlockStore
from dualpath.transport.nixl import NixlAgent, agent_name
from dualpath.transport.pacing import Pacer
from dualpath.transport.slots import SlotPool
from dualpath.transport.transfer_error import TransferError

KV_DEVICE = torch.device(os.environ.get("DUALPATH_TEST_DEVICE", "cpu"))  # conftest.py
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
NUM_BLOCKS, HEADS, BS, CH = 8, 2, 4, 6
PAGE = HEADS * BS * CH * 4
FULL = len(LAYERS) * PAGE
KEYS = block_keys(list(range(6 * BS)), BS)


def paged() -> dict[str, torch.Tensor]:
    return {n: torch.zeros(NUM_BLOCKS, HEADS, BS, CH, device=KV_DEVICE) for n in LAYERS}


def page_of(block: torch.Tensor, layer: int) -> torch.Tensor:
    return block[layer * PAGE:(layer + 1) * PAGE].view(torch.float32).view(HEADS, BS, CH)


def same(page: torch.Tensor, expected: torch.Tensor) -> bool:
    """Byte equality (random bytes read as float32 hold NaNs, which torch.equal rejects)."""
    return torch.equal(page.cpu().contiguous().view(torch.uint8),
                       expected.cpu().contiguous().view(torch.uint8))


@dataclass
class Pair:
    store: BlockStore
    stored: list[torch.Tensor]
    pool: StagingPool
    channel: DecodeSideChannel
    d_link: NixlAgent
    p_kv: dict[str, torch.Tensor]
    p_worker: KVWorker
    prefill: PrefillRemote
    d_worker: KVWorker


@pytest.fixture(params=["direct", "bounce"])
def pair(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Pair]:
    """Every test of the pair runs both ways: NIXL into and out of the paged KV itself, and
    through pinned host bounce buffers (a GPU node without GPUDirect RDMA; forced here)."""
    store = BlockStore(tmp_path / "store", FULL, is_durable=False)
    g = torch.Generator().manual_seed(1)
    stored = []
    for key in KEYS[:3]:
        block = torch.randint(0, 255, (FULL,), dtype=torch.uint8, generator=g)
        store.put(key, block.numpy().data)
        stored.append(block)
    pool = StagingPool(SlotPool(None, FULL, 6))
    d_link = NixlAgent(agent_name("decode-test"), progress_thread=True)  # the transfers' target
    d_link.register([(pool.base, pool.num_slots * FULL)])
    channel = DecodeSideChannel("127.0.0.1:0", pool, store, d_link.metadata(), d_link.connect)
    p_kv = paged()
    p_worker = KVWorker(store, LAYERS, PAGE)
    prefill = PrefillRemote(p_worker, p_kv, host_bounce=request.param == "bounce")
    d_worker = KVWorker(store, LAYERS, PAGE)
    yield Pair(store, stored, pool, channel, d_link, p_kv, p_worker, prefill, d_worker)
    prefill.close()
    channel.close()
    d_link.close()
    pool.close()


def prefill_step(p: Pair, plan: StepPlan, computed: dict[int, torch.Tensor]) -> None:
    """vLLM's order on the prefill worker; `computed[block_id]` is what "attention" writes."""
    p.p_worker.bind(plan)
    p.prefill.bind(plan)
    p.prefill.request_stages()  # the connector's order: stages requested, own reads, pulls
    p.p_worker.load()
    p.prefill.load()
    for i, name in enumerate(LAYERS):
        p.prefill.inject(name)
        p.p_worker.inject(name, p.p_kv[name])
        for block_id, block in computed.items():
            p.p_kv[name][block_id].copy_(page_of(block, i))
        p.p_worker.capture(name, p.p_kv[name])
        p.prefill.capture(name)
    p.prefill.flush()
    p.p_worker.flush()


def decode_step(p: Pair, load: XferLoad) -> dict[str, torch.Tensor]:
    kv = paged()
    remote = DecodeRemote(p.d_worker, p.pool)
    plan = StepPlan(xfer_loads=[load])
    p.d_worker.bind(plan)
    remote.bind(plan)
    p.d_worker.load()
    remote.load()
    for name in LAYERS:
        p.d_worker.inject(name, kv[name])
        remote.inject(name, kv[name])
    p.d_worker.flush()
    remote.flush()
    return kv


def test_de_hits_pulled_per_layer_and_only_missing_blocks_pushed(pair: Pair) -> None:
    p = pair
    de = p.channel.address
    tail = torch.randint(0, 255, (FULL,), dtype=torch.uint8)
    # Blocks 0-2 of the request are hits, all on the DE side; block 3 is computed here.
    plan = StepPlan(
        remote_loads=[RemoteLoad("x", de, BlockTransfer("r", 0, (5, 1, 6), tuple(KEYS[:3])))],
        pushes=[Push("x", de, "r", (3,), (5, 1, 6, 2), hit_blocks=3)])
    prefill_step(p, plan, {2: tail})
    for i, name in enumerate(LAYERS):
        for block_id, block in zip((5, 1, 6), p.stored, strict=True):
            assert same(p.p_kv[name][block_id], page_of(block, i))
    assert p.p_worker.counters.pulled_blocks == 3 and p.p_worker.counters.pushed_blocks == 1
    assert p.p_worker.take_load_errors() == set()
    assert p.channel.num_staged_blocks == 3
    # The decode side holds blocks 0-2 (staged) and 3 (pushed) under the transfer.
    kv = decode_step(p, XferLoad("x", "r", 0, (0, 3, 4, 7)))
    for i, name in enumerate(LAYERS):
        for block_id, block in zip((0, 3, 4, 7), [*p.stored, tail], strict=True):
            assert same(kv[name][block_id], page_of(block, i))
    assert p.d_worker.take_load_errors() == set()
    assert p.pool.num_free == p.pool.num_slots  # released after the load


def test_missing_de_block_is_a_load_error_and_is_pushed_after_recompute(pair: Pair) -> None:
    p = pair
    de = p.channel.address
    p.store.remove(KEYS[1])
    plan = StepPlan(
        remote_loads=[RemoteLoad("x", de, BlockTransfer("r", 0, (5, 1, 6), tuple(KEYS[:3])))])
    prefill_step(p, plan, {})
    assert p.p_worker.take_load_errors() == {1}  # vLLM recomputes from block 1 on
    assert p.p_worker.counters.pulled_blocks == 1
    # The recompute step pushes what the decode side now lacks: its own blocks 1-2 too.
    recomputed = {1: torch.randint(0, 255, (FULL,), dtype=torch.uint8),
                  6: torch.randint(0, 255, (FULL,), dtype=torch.uint8)}
    prefill_step(p, StepPlan(pushes=[Push("x", de, "r", (), (5, 1, 6), hit_blocks=3)]),
                 recomputed)
    assert p.p_worker.counters.pushed_blocks == 2
    kv = decode_step(p, XferLoad("x", "r", 0, (0, 3, 4)))
    assert p.d_worker.take_load_errors() == set()
    for i, name in enumerate(LAYERS):
        assert same(kv[name][0], page_of(p.stored[0], i))
        assert same(kv[name][3], page_of(recomputed[1], i))
        assert same(kv[name][4], page_of(recomputed[6], i))


def test_dead_side_channel_is_a_load_error_not_a_crash(pair: Pair) -> None:
    p = pair
    plan = StepPlan(remote_loads=[RemoteLoad(
        "x", "127.0.0.1:1", BlockTransfer("r", 0, (5, 1), tuple(KEYS[:2])))],
        pushes=[Push("x", "127.0.0.1:1", "r", (2,), (5, 1, 6), hit_blocks=2)])
    prefill_step(p, plan, {})
    assert p.p_worker.take_load_errors() == {5}
    assert p.p_worker.counters.remote_errors == 1
    # The request's load failed: nothing is pushed now (it is, after the recompute).
    assert p.p_worker.counters.pushed_blocks == 0


def test_decode_side_lacking_a_block_reports_it(pair: Pair) -> None:
    p = pair
    p.pool.alloc("y", [0, 1])  # allocated by a prefill that never committed
    kv = decode_step(p, XferLoad("y", "r", 0, (2, 3)))
    assert p.d_worker.take_load_errors() == {2}
    assert not kv[LAYERS[0]].any()
    assert decode_step(p, XferLoad("unknown", "r", 0, (4,))) is not None
    assert p.d_worker.take_load_errors() == {4}


def test_a_peer_agent_is_added_once_whatever_the_connections(pair: Pair) -> None:
    p = pair
    added: list[bytes] = []
    channel = DecodeSideChannel("127.0.0.1:0", p.pool, p.store, p.d_link.metadata(),
                                lambda m: added.append(m) or "peer")
    clients = [SideChannelClient(channel.address) for _ in range(3)]
    for c in clients:
        assert c.hello(b"agent-a").full_block_bytes == FULL
    clients[0].hello(b"")
    assert added == [b"agent-a"]
    for c in clients:
        c.close()
    channel.close()


def test_a_restarted_decode_node_is_reached_at_its_new_agent(pair: Pair) -> None:
    # `dualpath vllm up` restarts a dead decode instance on the same side-channel port; its
    # staging service is a new process with a new NIXL agent and buffer.
    p = pair
    de = p.channel.address

    def pull(xfer: str, block_ids: tuple[int, ...]) -> set[int]:
        plan = StepPlan(remote_loads=[RemoteLoad(xfer, de, BlockTransfer(
            "r", 0, block_ids, tuple(KEYS[:2])))])
        prefill_step(p, plan, {})
        return p.p_worker.take_load_errors()

    assert pull("a", (5, 1)) == set()
    p.channel.close()
    p.d_link.close()
    p.pool.close()
    p.pool = StagingPool(SlotPool(None, FULL, 6))
    p.d_link = NixlAgent(agent_name("decode-test"), progress_thread=True)
    p.d_link.register([(p.pool.base, p.pool.num_slots * FULL)])
    p.channel = DecodeSideChannel(de, p.pool, p.store, p.d_link.metadata(), p.d_link.connect)
    pull("b", (2, 3))  # may find the old connection dead: a load error, recomputed
    assert pull("c", (4, 6)) == set()
    for i, name in enumerate(LAYERS):
        for block_id, block in zip((4, 6), p.stored[:2], strict=True):
            assert same(p.p_kv[name][block_id], page_of(block, i))


def test_two_requests_pulled_and_pushed_in_one_step_each_get_their_own_pages(
        pair: Pair) -> None:
    """Several requests share a step's pulls and pushes (one bounce buffer each way, a run
    of rows per request): each request's blocks land where its own block ids say."""
    p = pair
    de = p.channel.address
    computed = {b: torch.randint(0, 255, (FULL,), dtype=torch.uint8) for b in (0, 2, 3)}
    plan = StepPlan(
        remote_loads=[RemoteLoad("x", de, BlockTransfer("r", 0, (5, 1), tuple(KEYS[:2]))),
                      RemoteLoad("y", de, BlockTransfer("s", 0, (6,), (KEYS[0],)))],
        pushes=[Push("x", de, "r", (2, 3), (5, 1, 2, 3), hit_blocks=2),
                Push("y", de, "s", (1,), (6, 0), hit_blocks=1)])
    prefill_step(p, plan, computed)
    assert p.p_worker.take_load_errors() == set()
    for i, name in enumerate(LAYERS):
        for block_id, block in zip((5, 1, 6), [*p.stored[:2], p.stored[0]], strict=True):
            assert same(p.p_kv[name][block_id], page_of(block, i))
    kv_r = decode_step(p, XferLoad("x", "r", 0, (0, 1, 2, 3)))
    kv_s = decode_step(p, XferLoad("y", "s", 0, (4, 5)))
    assert p.d_worker.take_load_errors() == set()
    for i, name in enumerate(LAYERS):
        for block_id, block in zip((0, 1, 2, 3), [*p.stored[:2], computed[2], computed[3]],
                                   strict=True):
            assert same(kv_r[name][block_id], page_of(block, i))
        assert same(kv_s[name][4], page_of(p.stored[0], i))
        assert same(kv_s[name][5], page_of(computed[0], i))


def test_the_connector_option_of_the_host_bounce() -> None:
    assert host_bounce_option("auto") is None and host_bounce_option(None) is None
    assert host_bounce_option("on") is True and host_bounce_option(True) is True
    assert host_bounce_option("OFF") is False and host_bounce_option("false") \
        is False
    with pytest.raises(ValueError, match="auto, on or off"):
        host_bounce_option("sometimes")


def test_the_host_bounce_is_on_by_default_only_for_gpu_kv(pair: Pair) -> None:
    prefill = PrefillRemote(pair.p_worker, pair.p_kv)
    try:
        assert prefill.host_bounce == (KV_DEVICE.type == "cuda")
    finally:
        prefill.close()


@pytest.mark.parametrize("pair", ["bounce"], indirect=True)
def test_bounce_buffers_are_registered_once_and_reused_across_steps(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    p = pair
    de = p.channel.address
    registered: list[int] = []
    register = p.prefill.link.register

    def counted(regions: list[tuple[int, int]], *args: object) -> None:
        registered.append(len(regions))
        register(regions, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(p.prefill.link, "register", counted)

    def step(n: int) -> None:
        computed = {2: torch.randint(0, 255, (FULL,), dtype=torch.uint8)}
        plan = StepPlan(
            remote_loads=[RemoteLoad(f"x{n}", de, BlockTransfer("r", 0, (5, 1, 6),
                                                               tuple(KEYS[:3])))],
            pushes=[Push(f"x{n}", de, "r", (3,), (5, 1, 6, 2), hit_blocks=3)])
        prefill_step(p, plan, computed)
        assert p.p_worker.take_load_errors() == set()
        for i, name in enumerate(LAYERS):
            for block_id, block in zip((5, 1, 6), p.stored, strict=True):
                assert same(p.p_kv[name][block_id], page_of(block, i))
        kv = decode_step(p, XferLoad(f"x{n}", "r", 3, (7,)))
        assert p.d_worker.take_load_errors() == set()
        for i, name in enumerate(LAYERS):
            assert same(kv[name][7], page_of(computed[2], i))
        for name in LAYERS:
            p.p_kv[name].zero_()

    step(0)
    assert len(registered) == 2  # the pulls' buffer and the pushes'
    step(1)
    step(2)
    assert len(registered) == 2  # reused, not registered again
    assert p.p_worker.counters.pulled_blocks == 9 and p.p_worker.counters.pushed_blocks == 3


@pytest.mark.parametrize("pair", ["bounce"], indirect=True)
def test_a_failed_read_through_the_bounce_is_a_load_error(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    p = pair
    de = p.channel.address
    post = p.prefill.link.post_prepped

    class Failed:
        def wait(self, timeout_s: float = 0) -> int:
            raise TransferError("NIXL READ with the decode node failed (ERR_REMOTE_DISCONNECT)")

    def failing(op: str, *args: object) -> object:
        pending = post(op, *args)  # type: ignore[arg-type]
        if op == "READ" and pending is not None:
            pending.wait()  # the bytes land; the batch reports an error all the same
            return Failed()
        return pending

    monkeypatch.setattr(p.prefill.link, "post_prepped", failing)
    plan = StepPlan(remote_loads=[
        RemoteLoad("x", de, BlockTransfer("r", 0, (5, 1), tuple(KEYS[:2]))),
        RemoteLoad("y", de, BlockTransfer("s", 0, (6,), (KEYS[2],)))])
    prefill_step(p, plan, {})
    assert p.p_worker.take_load_errors() == {5, 6}  # each request from its first block
    assert p.p_worker.counters.remote_errors == 2 * len(LAYERS)
    monkeypatch.setattr(p.prefill.link, "post_prepped", post)
    plan = StepPlan(remote_loads=[RemoteLoad("z", de, BlockTransfer("r", 0, (3, 4),
                                                                    tuple(KEYS[:2])))])
    prefill_step(p, plan, {})  # the same buffer, fine again
    assert p.p_worker.take_load_errors() == set()
    for i, name in enumerate(LAYERS):
        for block_id, block in zip((3, 4), p.stored[:2], strict=True):
            assert same(p.p_kv[name][block_id], page_of(block, i))


@pytest.mark.parametrize("pair", ["bounce"], indirect=True)
def test_a_background_pull_bounces_in_chunks_and_keeps_the_chunks_before_a_failure(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    p = pair
    de = p.channel.address
    monkeypatch.setattr(staged_pull, "BOUNCE_CHUNK_BYTES", 2 * FULL)  # two blocks at a time
    assert p.prefill.pull_whole(RemoteLoad("x", de, BlockTransfer(
        "r", 0, (5, 1, 6), tuple(KEYS[:3])))) == 3
    for i, name in enumerate(LAYERS):
        for block_id, block in zip((5, 1, 6), p.stored, strict=True):
            assert same(p.p_kv[name][block_id], page_of(block, i))
    post = p.prefill.link.post_prepped
    calls: list[str] = []

    def second_fails(op: str, *args: object) -> object:
        calls.append(op)
        if len(calls) == 2:
            raise TransferError("NIXL READ could not start (ERR_BACKEND)")
        return post(op, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(p.prefill.link, "post_prepped", second_fails)
    assert p.prefill.pull_whole(RemoteLoad("y", de, BlockTransfer(
        "r", 0, (2, 3, 4), tuple(KEYS[:3])))) == 2  # the first chunk's blocks
    for i, name in enumerate(LAYERS):
        for block_id, block in zip((2, 3), p.stored[:2], strict=True):
            assert same(p.p_kv[name][block_id], page_of(block, i))
    assert p.p_worker.counters.remote_errors == 1


def test_a_background_load_is_staged_in_pieces() -> None:
    assert staged_pull.stage_chunks(0, 4) == []
    assert staged_pull.stage_chunks(10, 4) == [(0, 8), (8, 10)]  # pieces of at least 8 blocks
    assert staged_pull.stage_chunks(100, 4) == [(0, 25), (25, 50), (50, 75), (75, 100)]
    assert staged_pull.stage_chunks(100, 1) == [(0, 100)]
    # Files of 8 blocks, the load from block 3: every piece but the last ends on a file edge
    # (absolute blocks 32, 64, 96), so no file is staged twice.
    assert staged_pull.stage_chunks(100, 4, 3, 8) == [(0, 29), (29, 61), (61, 93), (93, 100)]
    assert staged_pull.stage_chunks(5, 4, 3, 8) == [(0, 5)]
    with pytest.raises(ValueError, match="stage_pieces"):
        PrefillRemote(KVWorker(BlockStore(Path("/nonexistent"), FULL), LAYERS, PAGE), paged(),
                      stage_pieces=0)


def test_a_pipelined_background_pull_keeps_the_pieces_before_a_failed_stage(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every piece's stage is sent at once; the one whose store read fails ends the load there
    (the rest is recomputed), its later pieces' replies are still taken (none reads into a
    slot afterwards, the connection stays in step) and every slot goes back on release."""
    p = pair
    de = p.channel.address
    monkeypatch.setattr(staged_pull, "MIN_STAGE_PIECE_BLOCKS", 1)
    p.prefill.stage_pieces = 3  # a piece per block
    assert p.prefill.pull_whole(RemoteLoad("x", de, BlockTransfer(
        "r", 0, (5, 1, 6), tuple(KEYS[:3])))) == 3
    for i, name in enumerate(LAYERS):
        for block_id, block in zip((5, 1, 6), p.stored, strict=True):
            assert same(p.p_kv[name][block_id], page_of(block, i))
    p.store.remove(KEYS[1])
    for layer in p.p_kv.values():
        layer.zero_()
    assert p.prefill.pull_whole(RemoteLoad("y", de, BlockTransfer(
        "r", 0, (2, 3, 4), tuple(KEYS[:3])))) == 1  # piece 0; piece 1's read failed
    for i, name in enumerate(LAYERS):
        assert same(p.p_kv[name][2], page_of(p.stored[0], i))
        assert not p.p_kv[name][3].any() and not p.p_kv[name][4].any()
    assert p.channel.num_stage_errors == 1
    assert p.channel.num_staged_blocks == 3 + 2  # piece 2 was read all the same
    assert p.p_worker.counters.pulled_blocks == 4
    for name in list(p.pool._xfers):  # the decode side lets both transfers go
        p.pool.release(name)
    assert p.pool.num_free == p.pool.num_slots
    # The same thread's connection is still in step: the next load's replies are its own.
    assert p.prefill.pull_whole(RemoteLoad("z", de, BlockTransfer(
        "r", 0, (7, 8), (KEYS[0], KEYS[1])))) == 1
    assert p.p_worker.counters.remote_errors == 0  # a missing block is not a fault of the peer


def test_background_loads_read_both_sides_and_report_when_done(pair: Pair) -> None:
    p = pair
    de = p.channel.address
    p.p_worker.register(p.p_kv)
    loader = AsyncLoader(p.p_worker, p.prefill)
    p.store.remove(KEYS[2])  # the DE part's second block is gone
    plan = StepPlan(
        async_loads=[BlockTransfer("r", 0, (5,), (KEYS[0],))],
        async_remote_loads=[RemoteLoad("x", de, BlockTransfer("r", 1, (1, 6), tuple(KEYS[1:3])))])
    loader.submit(plan)
    deadline = time.monotonic() + 30
    done: set[str] = set()
    errors: set[int] = set()
    while not done and time.monotonic() < deadline:
        errors |= loader.take_errors()
        done |= loader.take_finished()
        time.sleep(0.01)
    errors |= loader.take_errors()
    assert done == {"r"} and errors == {6}  # finished, block 6 (request block 2) recomputed
    for i, name in enumerate(LAYERS):
        assert same(p.p_kv[name][5], page_of(p.stored[0], i))
        assert same(p.p_kv[name][1], page_of(p.stored[1], i))
    # The push after the recompute carries the block the decode side could not stage.
    prefill_step(p, StepPlan(pushes=[Push("x", de, "r", (0,), (5, 1, 6), hit_blocks=3)]),
                 {6: torch.randint(0, 255, (FULL,), dtype=torch.uint8)})
    assert p.p_worker.counters.pushed_blocks == 2  # blocks 0 and 2
    loader.close()


def test_a_burst_of_pe_side_loads_does_not_hold_up_de_side_pulls(pair: Pair) -> None:
    """Each read path has its own threads: the DE pull, submitted after more PE loads than
    there are threads, finishes while the (slow, NIC-paced) PE loads are still reading."""
    p = pair
    p.p_worker.register(p.p_kv)
    p.p_worker.pacer = Pacer(FULL / 0.5)  # one block per 0.5 s on this NIC
    loader = AsyncLoader(p.p_worker, p.prefill, max_workers=1)
    plan = StepPlan(
        async_loads=[BlockTransfer(f"pe{i}", 0, (i,), (KEYS[0],)) for i in range(4)],
        async_remote_loads=[RemoteLoad("x", p.channel.address,
                                       BlockTransfer("de", 1, (5,), (KEYS[1],)))])
    loader.submit(plan)
    deadline = time.monotonic() + 30
    done: list[str] = []
    while len(done) < 5 and time.monotonic() < deadline:
        done += sorted(loader.take_finished())
        time.sleep(0.01)
    assert loader.take_errors() == set()
    assert "de" in done and done.index("de") < 2, done  # not after the 2 s of PE reads
    assert same(p.p_kv[LAYERS[0]][5], page_of(p.stored[1], 0))
    loader.close()


def test_side_channel_process_serves_pulls_and_the_decode_workers_loads(
        tmp_path: Path) -> None:
    """The decode node's buffer service as its own process (how the connector runs it):
    shared-memory staging, its own NIXL agent; a prefill worker pulls, the decode worker
    loads from the same bytes."""
    store = BlockStore(tmp_path / "store", FULL, is_durable=False)
    blocks = [torch.randint(0, 255, (FULL,), dtype=torch.uint8) for _ in range(2)]
    for key, block in zip(KEYS, blocks, strict=False):
        store.put(key, block.numpy().data)
    address = f"127.0.0.1:{free_port()}"
    proc, pool = spawn_side_channel(address, str(store.root), FULL, 4, None,
                                    str(tmp_path / "events.jsonl"), "ns")
    # Both processes map the buffer, so its name is gone already: no segment can outlive
    # them, however they end (the bytes below still cross it).
    assert not list(Path("/dev/shm").glob(f"dualpath-staging-{proc.pid}"))
    try:
        p_kv = paged()
        p_worker = KVWorker(store, LAYERS, PAGE)
        prefill = PrefillRemote(p_worker, p_kv)
        assert prefill.pull_whole(RemoteLoad("x", address, BlockTransfer(
            "r", 0, (3, 4), tuple(KEYS[:2])))) == 2
        for i, name in enumerate(LAYERS):
            assert same(p_kv[name][3], page_of(blocks[0], i))
            assert same(p_kv[name][4], page_of(blocks[1], i))
        d_worker = KVWorker(store, LAYERS, PAGE)
        remote = DecodeRemote(d_worker, pool)
        plan = StepPlan(xfer_loads=[XferLoad("x", "r", 0, (6, 7))])
        d_worker.bind(plan)
        remote.bind(plan)
        remote.load()
        kv = paged()
        for name in LAYERS:
            remote.inject(name, kv[name])
        remote.flush()
        for i, name in enumerate(LAYERS):
            assert same(kv[name][6], page_of(blocks[0], i))
            assert same(kv[name][7], page_of(blocks[1], i))
        assert d_worker.take_load_errors() == set()
        assert pool.lookup("x", [0]) == [None]  # released
        prefill.close()
        pool.close()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    assert not list(Path("/dev/shm").glob(f"dualpath-staging-{proc.pid}"))


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of every thread of process `pid` so far."""
    import os

    ticks = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(") ", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def test_an_idle_side_channel_process_sleeps(tmp_path: Path) -> None:
    """The staging service's UCX progress thread waits in poll() between transfers: NIXL's
    Python wrapper would make it spin (about 80% of a core here, taken from vLLM)."""
    address = f"127.0.0.1:{free_port()}"
    proc, pool = spawn_side_channel(address, str(tmp_path), FULL, 2, None, None, "ns")
    try:
        time.sleep(1.0)  # past start-up
        before = _cpu_seconds(proc.pid)
        time.sleep(2.0)
        busy = (_cpu_seconds(proc.pid) - before) / 2.0
        assert busy < 0.4, f"the idle side-channel process used {busy:.0%} of a core"
        pool.close()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def _cpus_allowed(pid: int) -> set[int]:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                if x.startswith("Cpus_allowed_list:"))
    return set(instance_cpus(line.split(":", 1)[1].strip()))


def test_the_side_channel_runs_on_its_instance_cores_not_the_pinned_worker_core(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM pins a CPU worker's main thread to one core; the staging service it starts
    must not inherit that pin (there it starved, with the engine, for tens of seconds)."""
    mine = os.sched_getaffinity(0)
    first = min(mine)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    os.sched_setaffinity(0, {first})  # as vLLM leaves the decode worker
    try:
        address = f"127.0.0.1:{free_port()}"
        proc, pool = spawn_side_channel(address, str(tmp_path), FULL, 2, None, None, "ns")
    finally:
        os.sched_setaffinity(0, mine)
    try:
        assert _cpus_allowed(proc.pid) == mine | {first}
        pool.close()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", str(first))  # an instance's own core
    address = f"127.0.0.1:{free_port()}"
    proc, pool = spawn_side_channel(address, str(tmp_path), FULL, 2, None, None, "ns")
    try:
        assert _cpus_allowed(proc.pid) == {first}
        pool.close()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_instance_cpus_reads_vllm_core_lists() -> None:
    assert instance_cpus("0-2,5|7") == [0, 1, 2, 5, 7]
    assert instance_cpus("3") == [3]
    every = instance_cpus(None)
    assert instance_cpus("auto") == every == instance_cpus("nobind")
    assert set(os.sched_getaffinity(0)) <= set(every)
    with pytest.raises(ValueError, match="'x1'"):
        instance_cpus("0,x1")


PREFILL_HOST_SCRIPT = """
import json, sys
import torch
from dualpath.core.blocks import block_keys
from dualpath.store import BlockStore
from dualpath.integrations.vllm.connector.kvio import KVWorker
from dualpath.integrations.vllm.connector.step_plan import BlockTransfer, Push, RemoteLoad, StepPlan
from dualpath.integrations.vllm.connector.remote import PrefillRemote
from dualpath.integrations.vllm.connector.side_channel.auth import load_secret

store_root, address, layers, page, full, heads, bs, ch = json.loads(sys.argv[1])
keys = block_keys(list(range(2 * bs)), bs)
store = BlockStore(store_root, full, is_durable=False)
kv = {n: torch.zeros(8, heads, bs, ch) for n in layers}
prefill = PrefillRemote(KVWorker(store, layers, page), kv, secret=load_secret())
pulled = prefill.pull_whole(RemoteLoad("x", address, BlockTransfer("r", 0, (3, 4), tuple(keys))))
block = torch.empty(full, dtype=torch.uint8)
same = []
for bid, key in zip((3, 4), keys):
    store.get_into(key, block.numpy())
    same.append(all(torch.equal(kv[n][bid].flatten().view(torch.uint8),
                                block[i * page:(i + 1) * page]) for i, n in enumerate(layers)))
torch.manual_seed(1)
for n in layers:
    kv[n][5].copy_(torch.randn(heads, bs, ch))
plan = StepPlan(pushes=[Push("y", address, "r2", (2,), (3, 4, 5), hit_blocks=2)])
prefill.bind(plan)
for n in layers:
    prefill.capture(n)
prefill.flush()
pushed = torch.cat([kv[n][5].flatten().view(torch.uint8) for n in layers])
print(json.dumps({"pulled": pulled, "same": same, "pushed": prefill.kv.counters.pushed_blocks,
                  "pushed_bytes": pushed.tolist()}))
prefill.close()
"""


def test_de_path_between_two_emulated_hosts(tmp_path: Path) -> None:
    """A prefill worker and a decode node's staging service on two emulated hosts (network
    namespaces on a bridge, UCX held to TCP on their veth): the DE-side pull and the push
    of a block the decode side lacks cross the "network", byte for byte, between peers that
    hold the cluster's secret (a non-loopback side channel needs one)."""
    import json
    import os
    import subprocess
    import sys

    from dualpath.integrations.vllm.cluster import netns

    why = netns.available()
    if why is not None:
        pytest.skip(why)
    store = BlockStore(tmp_path / "store", FULL, is_durable=False)
    blocks = [torch.randint(0, 255, (FULL,), dtype=torch.uint8) for _ in range(2)]
    for key, block in zip(KEYS, blocks, strict=False):
        store.put(key, block.numpy().data)
    with netns.Hosts() as hosts:
        decode_host, prefill_host = hosts.add(), hosts.add()
        address = f"{decode_host.address}:{free_port()}"
        secret = os.urandom(16).hex()
        proc, pool = spawn_side_channel(address, str(store.root), FULL, 4, None, None, "ns",
                                        command_prefix=decode_host.command([]),
                                        env=netns.HOST_ENV, secret=secret.encode())
        try:
            args = json.dumps([str(store.root), address, LAYERS, PAGE, FULL, HEADS, BS, CH])
            run = subprocess.run(prefill_host.command([sys.executable, "-c",
                                                       PREFILL_HOST_SCRIPT, args]),
                                 capture_output=True, text=True, timeout=120, check=False,
                                 env={**os.environ, **netns.HOST_ENV,
                                      "DUALPATH_SIDE_CHANNEL_SECRET": secret})
            assert run.returncode == 0, run.stderr[-3000:]
            out = json.loads(run.stdout.strip().splitlines()[-1])
            assert out["pulled"] == 2 and out["same"] == [True, True]
            assert out["pushed"] == 1
            [slot] = pool.lookup("y", [2])
            assert slot is not None
            staged = pool.view(slot)
            assert staged.tolist() == out["pushed_bytes"]
            pool.close()
        finally:
            proc.terminate()
            assert proc.wait(30) == 0
