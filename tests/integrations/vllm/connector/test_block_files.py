"""A store file holding several vLLM blocks (issue 29, finding 8): 16-token blocks, g = 8 a file.

The scheduler's `Planner` plans, a real `BlockStore` holds the files, `KVWorker` moves the
pages (PE path), and a decode node's staging service with real NIXL transfers stages and serves
them (DE path): the bytes come back, a hit counts whole files (as the router counts them), a
request's last partial file is not saved until it completes, and g = 1 is a file per block.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dualpath.core.blocks import block_keys, hit_blocks
from dualpath.core.errors import SpecError
from dualpath.integrations.vllm.connector.key_namespace import namespace_key
from dualpath.integrations.vllm.connector.kvio import KVWorker
from dualpath.integrations.vllm.connector.pages import LayoutError
from dualpath.integrations.vllm.connector.plan import Planner
from dualpath.integrations.vllm.connector.step_plan import (
    BlockTransfer,
    RemoteLoad,
    StepPlan,
    XferLoad,
    check_blocks_per_file,
    default_blocks_per_file,
)
from dualpath.integrations.vllm.manifest import RouteParams, Shard, StoreManifest
from dualpath.store import BlockStore

KV_DEVICE = torch.device(os.environ.get("DUALPATH_TEST_DEVICE", "cpu"))  # conftest.py
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
NUM_BLOCKS, HEADS, BS, CH = 64, 1, 16, 4  # vLLM's 16-token blocks
PAGE = HEADS * BS * CH * 4
FULL = len(LAYERS) * PAGE
G = 8
NS = namespace_key("files", BS, G)
PROMPT = [(13 * i) % 1000 for i in range(20 * BS)]  # 20 full blocks: 2 whole files + 4 blocks


def paged(seed: int | None = None) -> dict[str, torch.Tensor]:
    if seed is None:
        return {n: torch.zeros(NUM_BLOCKS, HEADS, BS, CH, device=KV_DEVICE) for n in LAYERS}
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(NUM_BLOCKS, HEADS, BS, CH, generator=gen).to(KV_DEVICE)
            for n in LAYERS}


def store_of(root: Path, g: int = G) -> BlockStore:
    return BlockStore(root, g * FULL, is_durable=False)


def step(worker: KVWorker, plan: StepPlan, kv: dict[str, torch.Tensor]) -> set[int]:
    """vLLM's calling order on a worker: loads, per layer inject then capture, flush."""
    worker.bind(plan)
    worker.load()
    for name in LAYERS:
        worker.inject(name, kv[name])
        worker.capture(name, kv[name])
    worker.flush()
    return worker.take_load_errors()


def run(planner: Planner, req: str, block_ids: list[int], num_tokens: int, local: int = 0,
        hit: int = 0) -> StepPlan:
    """The scheduler side of a step scheduling a new request of `num_tokens` tokens whole:
    `local` computed tokens (vLLM's prefix cache), then `hit` loaded ones."""
    planner.after_alloc(req, hit)
    planner.schedule_new(req, block_ids, local + hit, num_tokens - local - hit)
    return planner.take_plan()


def same_block(a: dict[str, torch.Tensor], i: int, b: dict[str, torch.Tensor], j: int) -> bool:
    return all(torch.equal(a[n][i].cpu(), b[n][j].cpu()) for n in LAYERS)


def saved_prompt(tmp_path: Path) -> tuple[BlockStore, KVWorker, dict[str, torch.Tensor]]:
    """Request "a" (the 20-block prompt) computed in one step on blocks 0..19 and saved."""
    store = store_of(tmp_path / "store")
    worker = KVWorker(store, LAYERS, PAGE, blocks_per_file=G)
    planner = Planner(BS, NS, store.contains, blocks_per_file=G)
    planner.add_request("a", PROMPT)
    assert planner.match("a", 0) == 0
    src = paged(0)
    plan = run(planner, "a", list(range(20)), len(PROMPT))
    assert [(s.first_block, len(s.block_ids), len(s.keys)) for s in plan.saves] == [(0, 16, 2)]
    assert step(worker, plan, src) == set()
    return store, worker, src


def test_a_prompt_is_saved_in_whole_files_and_its_partial_file_waits(tmp_path: Path) -> None:
    store = store_of(tmp_path / "store")
    worker = KVWorker(store, LAYERS, PAGE, blocks_per_file=G)
    planner = Planner(BS, NS, store.contains, role="decode", blocks_per_file=G)
    tokens = list(PROMPT)
    planner.add_request("a", tokens)
    kv = paged(3)
    step(worker, run(planner, "a", list(range(24)), len(tokens)), kv)
    keys = block_keys(tokens, BS, NS)
    assert sorted(store.keys()) == sorted([keys[7], keys[15]])  # two files, 16 blocks
    assert store.counters.num_puts == 2 and worker.counters.saved_blocks == 16
    # Decoding fills blocks 20.. one token a step: nothing is saved until block 23 is full.
    for _ in range(4 * BS - 1):
        tokens.append(7)
        planner.schedule_cached("a", None, is_resumed=False,
                                num_computed_tokens=len(tokens) - 1, num_scheduled_tokens=1)
        plan = planner.take_plan()
        assert not plan.saves, len(tokens)
        step(worker, plan, kv)
    tokens.append(7)
    planner.schedule_cached("a", None, is_resumed=False, num_computed_tokens=len(tokens) - 1,
                            num_scheduled_tokens=1)
    plan = planner.take_plan()
    assert [(s.first_block, s.block_ids, len(s.keys)) for s in plan.saves] == [
        (16, tuple(range(16, 24)), 1)]
    step(worker, plan, kv)
    assert store.contains(block_keys(tokens, BS, NS)[23]) and store.counters.num_puts == 3
    # The file holds blocks 16..23 whole: read back, they are the pages saved.
    other = KVWorker(store, LAYERS, PAGE, blocks_per_file=G)
    dst = paged()
    ids = tuple(range(40, 48))
    assert step(other, StepPlan(loads=[BlockTransfer("b", 16, ids, (plan.saves[0].keys[0],),
                                                     blocks_per_file=G)]), dst) == set()
    assert all(same_block(dst, 40 + j, kv, 16 + j) for j in range(8))


def test_a_hit_loads_whole_files_into_the_paged_kv_pe_path(tmp_path: Path) -> None:
    store, worker, src = saved_prompt(tmp_path)
    planner = Planner(BS, NS, store.contains, blocks_per_file=G)
    prompt = [*PROMPT, 1, 2, 3]
    planner.add_request("b", prompt)
    assert planner.match("b", 0) == 16 * BS  # 2 files; block 16..19 are no file yet
    dst = paged()
    ids = list(range(30, 51))
    plan = run(planner, "b", ids, len(prompt), hit=16 * BS)
    assert [(t.first_block, len(t.block_ids), len(t.keys)) for t in plan.loads] == [(0, 16, 2)]
    # Blocks 16..20 make no whole file; the loaded files are found stored, not rewritten.
    assert [(s.first_block, len(s.block_ids)) for s in plan.saves] == [(0, 16)]
    assert step(worker, plan, dst) == set()
    assert all(same_block(dst, 30 + i, src, i) for i in range(16))
    assert worker.counters.loaded_blocks == 16 and store.counters.num_hits == 2
    assert worker.counters.skipped_saves == 16 and store.counters.num_puts == 2


def test_a_hit_after_vllms_own_prefix_cache_reads_the_first_file_whole(tmp_path: Path) -> None:
    """vLLM's prefix cache holds blocks 0..2 (its cache ends inside file 0): the load reads
    file 0 whole and drops blocks 0..2, never writing vLLM's own (shared) pages."""
    store, worker, src = saved_prompt(tmp_path)
    planner = Planner(BS, NS, store.contains, blocks_per_file=G)
    planner.add_request("b", PROMPT)
    assert planner.match("b", 3 * BS) == 13 * BS
    dst = paged()
    ids = list(range(30, 50))
    plan = run(planner, "b", ids, len(PROMPT), local=3 * BS, hit=13 * BS)
    (t,) = plan.loads
    assert (t.first_block, len(t.block_ids), len(t.keys)) == (3, 13, 2)
    assert t.files()[0][1] == [None, None, None, 0, 1, 2, 3, 4]
    assert step(worker, plan, dst) == set()
    assert all(same_block(dst, 30 + i, src, i) for i in range(3, 16))
    assert not any(dst[n][30:33].any() for n in LAYERS)  # vLLM's cached blocks untouched
    # In place (host KV with contiguous pages, registered) and in the background alike.
    bg = paged()
    worker.register(bg)
    assert worker.load_whole(t) == 13
    assert all(same_block(bg, 30 + i, src, i) for i in range(3, 16))
    assert not any(bg[n][30:33].any() for n in LAYERS)


def test_a_missing_file_fails_all_its_blocks(tmp_path: Path) -> None:
    store, worker, src = saved_prompt(tmp_path)
    keys = block_keys(PROMPT, BS, NS)
    store.remove(keys[15])
    dst = paged()
    t = BlockTransfer("b", 0, tuple(range(30, 46)), (keys[7], keys[15]), blocks_per_file=G)
    assert step(worker, StepPlan(loads=[t]), dst) == {38}  # recomputed from block 8 on
    assert all(same_block(dst, 30 + i, src, i) for i in range(8))
    assert not any(dst[n][38:46].any() for n in LAYERS)
    # In the background, through staging (pages not contiguous: no reads in place).
    bg = {n: torch.zeros(NUM_BLOCKS, HEADS, CH, BS, device=KV_DEVICE).transpose(2, 3)
          for n in LAYERS}
    worker.register(bg)
    assert worker.load_whole(t) == 8
    assert all(same_block(bg, 30 + i, src, i) for i in range(8))
    assert not any(bg[n][38:46].any() for n in LAYERS)


def test_two_tensor_parallel_ranks_keep_their_own_files(tmp_path: Path) -> None:
    """Per-rank keys as before, per file: each rank saves its shard of the same files and
    loads its own back."""
    store = store_of(tmp_path / "store")
    ranks = [KVWorker(store, LAYERS, PAGE, shard=Shard(r, 2), blocks_per_file=G)
             for r in range(2)]
    planner = Planner(BS, NS, store.contains, num_shards=2, blocks_per_file=G)
    planner.add_request("a", PROMPT)
    plan = run(planner, "a", list(range(20)), len(PROMPT))
    shards = [paged(10 + r) for r in range(2)]
    for worker, kv in zip(ranks, shards, strict=True):
        step(worker, plan, kv)
    assert len(store.keys()) == 4  # 2 files x 2 ranks
    (saved,) = plan.saves
    load = BlockTransfer("b", 0, tuple(range(30, 46)), saved.keys, blocks_per_file=G)
    for worker, kv in zip(ranks, shards, strict=True):
        dst = paged()
        assert step(worker, StepPlan(loads=[load]), dst) == set()
        assert all(same_block(dst, 30 + i, kv, i) for i in range(16))


@pytest.mark.parametrize("g", [1, 2, 8])
def test_router_and_connector_count_the_same_whole_files(tmp_path: Path, g: int) -> None:
    manifest = StoreManifest(namespace=NS.hex(), model="m", block_size=BS,
                             full_block_bytes=FULL, blocks_per_file=g)
    keys = block_keys(PROMPT, BS, NS)
    for n, stored in enumerate([set(), {0}, {0, 1}, {1}, set(range(20 // g))]):
        store = store_of(tmp_path / f"s{g}-{n}", g)
        for f in stored:
            store.put(keys[f * g + g - 1], bytes(g * FULL))
        # The rule: leading stored files, never the prompt's last token.
        want = 0
        while want in stored and (want + 1) * g * BS <= len(PROMPT) - 1:
            want += 1
        router = manifest.hit_blocks(PROMPT, store.contains)
        single = Planner(BS, NS, store.contains, blocks_per_file=g)
        single.add_request("r", PROMPT)
        prefill = Planner(BS, NS, store.contains, role="prefill", blocks_per_file=g)
        prefill.add_request("r", PROMPT, RouteParams(xfer="x", de="d:1", hit_blocks=router,
                                                     pe_blocks=router))
        assert router == want * g, (g, stored)
        assert single.match("r", 0) == prefill.match("r", 0) == want * g * BS
        assert hit_blocks(keys, len(PROMPT), store.contains, BS,
                          blocks_per_file=g) == want * g


def test_one_block_a_file_is_todays_layout(tmp_path: Path) -> None:
    """g = 1: a file per block under the block's own key, the store's size one Full Block."""
    store = store_of(tmp_path / "store", 1)
    worker = KVWorker(store, LAYERS, PAGE)
    planner = Planner(BS, NS, store.contains)
    planner.add_request("a", PROMPT)
    src = paged(5)
    plan = run(planner, "a", list(range(20)), len(PROMPT))
    assert [(s.first_block, len(s.block_ids), len(s.keys)) for s in plan.saves] == [(0, 20, 20)]
    step(worker, plan, src)
    keys = block_keys(PROMPT, BS, NS)
    assert sorted(store.keys()) == sorted(keys)
    assert store.path_of(keys[4]).stat().st_size == store.file_bytes
    planner.add_request("b", PROMPT)
    assert planner.match("b", 0) == 19 * BS


def test_blocks_per_file_must_be_a_positive_integer(tmp_path: Path) -> None:
    for bad in (0, -8, "eight", 2.5, True, None):
        with pytest.raises(SpecError, match="blocks_per_file"):
            check_blocks_per_file(bad)
    assert check_blocks_per_file("8") == 8
    with pytest.raises(SpecError, match=r"vllm connector\.blocks_per_file=0"):
        Planner(BS, NS, lambda _key: False, blocks_per_file=0)
    with pytest.raises(SpecError, match="blocks_per_file"):
        StoreManifest(namespace=NS.hex(), model="m", block_size=BS, full_block_bytes=FULL,
                      blocks_per_file=0)
    with pytest.raises(LayoutError, match="8 blocks x 2 layers"):
        KVWorker(store_of(tmp_path / "s", 1), LAYERS, PAGE, blocks_per_file=G)
    with pytest.raises(ValueError, match="2 files of 8 blocks, got 1 keys"):
        BlockTransfer("r", 4, tuple(range(8)), (b"k" * 16,), blocks_per_file=G)
    assert [default_blocks_per_file(bs) for bs in (1, 16, 32, 64, 128, 256)] == [
        128, 8, 4, 2, 1, 1]


def test_the_launcher_passes_blocks_per_file_only_when_set(tmp_path: Path) -> None:
    from dualpath.integrations.vllm.cluster.command import kv_transfer_config
    from dualpath.integrations.vllm.cluster.spec import VllmClusterSpec

    spec = VllmClusterSpec(model="m", store=tmp_path, python="python")
    for role in ("prefill", "decode"):
        extra = kv_transfer_config(spec, role, "127.0.0.1:1", None)["kv_connector_extra_config"]
        assert "blocks_per_file" not in extra  # the connector's default
        extra = kv_transfer_config(VllmClusterSpec(model="m", store=tmp_path, python="python",
                                                   blocks_per_file=4), role, "127.0.0.1:1",
                                   None)["kv_connector_extra_config"]
        assert extra["blocks_per_file"] == 4


# -- the DE path: a decode node stages files into per-block slots, NIXL pulls them --------
nixl = pytest.importorskip("nixl", reason="nixl (UCX) is part of make setup")

from dualpath.integrations.vllm.connector import staged_pull  # noqa: E402
from dualpath.integrations.vllm.connector.decode_remote import DecodeRemote  # noqa: E402
from dualpath.integrations.vllm.connector.remote import PrefillRemote  # noqa: E402
from dualpath.integrations.vllm.connector.side_channel.staging import StagingPool  # noqa: E402
from dualpath.integrations.vllm.connector.side_channel.tcp_server import (  # noqa: E402
    DecodeSideChannel,
)
from dualpath.transport.nixl import NixlAgent, agent_name  # noqa: E402
from dualpath.transport.slots import SlotPool  # noqa: E402


@dataclass
class Decode:
    pool: StagingPool
    channel: DecodeSideChannel
    link: NixlAgent


@pytest.fixture
def decode(tmp_path: Path) -> Iterator[Decode]:
    store = store_of(tmp_path / "store")  # the same store as `saved_prompt`'s
    pool = StagingPool(SlotPool(None, FULL, 40))  # a slot per vLLM block
    link = NixlAgent(agent_name("decode-files"), progress_thread=True)
    link.register([(pool.base, pool.num_slots * FULL)])
    channel = DecodeSideChannel("127.0.0.1:0", pool, store, link.metadata(), link.connect)
    assert channel.blocks_per_file == G
    yield Decode(pool, channel, link)
    channel.close()
    link.close()
    pool.close()


def prefill_step(worker: KVWorker, prefill: PrefillRemote, plan: StepPlan,
                 kv: dict[str, torch.Tensor], computed: dict[int, torch.Tensor]) -> None:
    """The connector's order on a prefill worker; `computed[b]`: what attention writes."""
    worker.bind(plan)
    prefill.bind(plan)
    prefill.request_stages()
    worker.load()
    prefill.load()
    for name in LAYERS:
        prefill.inject(name)
        worker.inject(name, kv[name])
        for block_id, pages in computed.items():
            kv[name][block_id].copy_(pages[name])
        worker.capture(name, kv[name])
        prefill.capture(name)
    prefill.flush()
    worker.flush()


@pytest.mark.parametrize("bounce", [False, True], ids=["direct", "bounce"])
def test_a_routed_prefill_pulls_whole_files_and_pushes_the_rest(
        tmp_path: Path, decode: Decode, bounce: bool) -> None:
    """The router's split (pe_blocks=3) moves to the file edge: file 0 is read here (PE),
    file 1 staged by the decode node and pulled (DE); every other block is pushed, and the
    decode worker finds the whole prompt but its last token under the transfer."""
    store, _, src = saved_prompt(tmp_path)
    de = decode.channel.address
    worker = KVWorker(store, LAYERS, PAGE, blocks_per_file=G)
    kv = paged()
    prefill = PrefillRemote(worker, kv, host_bounce=bounce)
    try:
        planner = Planner(BS, NS, store.contains, role="prefill", blocks_per_file=G)
        prompt = [*PROMPT, 5]  # 20 full blocks and one token
        planner.add_request("b", prompt, RouteParams(xfer="x", de=de, hit_blocks=16,
                                                     pe_blocks=3))
        assert planner.match("b", 0) == 16 * BS
        ids = list(range(30, 51))
        plan = run(planner, "b", ids, len(prompt), hit=16 * BS)
        assert [(t.first_block, len(t.block_ids)) for t in plan.loads] == [(0, 8)]
        assert [(r.blocks.first_block, len(r.blocks.block_ids), len(r.blocks.keys))
                for r in plan.remote_loads] == [(8, 8, 1)]
        (push,) = plan.pushes
        assert push.block_indices == (*range(8), *range(16, 21))
        gen = torch.Generator().manual_seed(9)
        computed = {b: {n: torch.randn(HEADS, BS, CH, generator=gen).to(KV_DEVICE)
                        for n in LAYERS} for b in ids[16:]}
        prefill_step(worker, prefill, plan, kv, computed)
        assert worker.take_load_errors() == set()
        assert all(same_block(kv, 30 + i, src, i) for i in range(16))
        assert decode.channel.num_staged_blocks == 8
        assert worker.counters.pulled_blocks == 8 and worker.counters.pushed_blocks == 13
        # The decode worker: blocks 0..20 from the staging slots.
        d_worker = KVWorker(store, LAYERS, PAGE, blocks_per_file=G)
        d_kv = paged()
        remote = DecodeRemote(d_worker, decode.pool)
        d_plan = StepPlan(xfer_loads=[XferLoad("x", "b", 0, tuple(range(21)))])
        d_worker.bind(d_plan)
        remote.bind(d_plan)
        d_worker.load()
        remote.load()
        for name in LAYERS:
            remote.inject(name, d_kv[name])
        remote.flush()
        assert d_worker.take_load_errors() == set()
        assert all(same_block(d_kv, i, kv, 30 + i) for i in range(21))
        assert all(same_block(d_kv, i, src, i) for i in range(16))
        assert decode.pool.num_free == decode.pool.num_slots
    finally:
        prefill.close()


@pytest.mark.parametrize("pieces", [1, 4], ids=["whole", "pipelined"])
def test_a_stage_from_inside_a_file_drops_the_blocks_before(
        tmp_path: Path, decode: Decode, pieces: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks 3..15 (vLLM's prefix cache ends inside file 0): two files read, 13 slots; staged
    whole, or pipelined in pieces that end on file edges (blocks 3..7 = file 0, 8..15 = 1)."""
    store, _, src = saved_prompt(tmp_path)
    keys = block_keys(PROMPT, BS, NS)
    worker = KVWorker(store, LAYERS, PAGE, blocks_per_file=G)
    kv = paged()
    monkeypatch.setattr(staged_pull, "MIN_STAGE_PIECE_BLOCKS", 1)
    assert staged_pull.stage_chunks(13, pieces, 3, G) == ([(0, 13)] if pieces == 1
                                                          else [(0, 5), (5, 13)])
    prefill = PrefillRemote(worker, kv, stage_pieces=pieces)
    try:
        t = BlockTransfer("c", 3, tuple(range(33, 46)), (keys[7], keys[15]), blocks_per_file=G)
        assert prefill.pull_whole(RemoteLoad("y", decode.channel.address, t)) == 13
        assert all(same_block(kv, 30 + i, src, i) for i in range(3, 16))
        assert not any(kv[n][30:33].any() for n in LAYERS)
        assert decode.pool.num_free == decode.pool.num_slots - 13
        # A missing second file: the blocks of the first are offered, from block 8 on none.
        store.remove(keys[15])
        assert prefill.pull_whole(RemoteLoad("z", decode.channel.address, t)) == 5
    finally:
        prefill.close()
