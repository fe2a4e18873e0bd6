"""Tensor-parallel ranks in the P/D data plane (`remote`) without vLLM: two prefill ranks and
two decode ranks (each decode rank a staging buffer and side channel of its own, on the
instance's port + its rank), one shared store holding each rank's shard of every block. Each
prefill rank pulls its own shard of the DE-side hits and pushes its own computed pages; each
decode rank loads only its own: no rank ever gets another's heads."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("nixl", reason="nixl (UCX) is part of make setup")

from dualpath.core.blocks import block_keys
from dualpath.integrations.vllm.cluster.ports import free_ports
from dualpath.integrations.vllm.connector.decode_remote import DecodeRemote
from dualpath.integrations.vllm.connector.kvio import KVWorker
from dualpath.integrations.vllm.connector.remote import PrefillRemote
from dualpath.integrations.vllm.connector.side_channel.staging import StagingPool
from dualpath.integrations.vllm.connector.side_channel.tcp_server import DecodeSideChannel
from dualpath.integrations.vllm.connector.step_plan import (
    BlockTransfer,
    Push,
    RemoteLoad,
    StepPlan,
    XferLoad,
)
from dualpath.integrations.vllm.manifest import Shard
from dualpath.store import BlockStore
from dualpath.transport.nixl import NixlAgent, agent_name
from dualpath.transport.slots import SlotPool

TP = 2
KV_DEVICE = torch.device(os.environ.get("DUALPATH_TEST_DEVICE", "cpu"))  # conftest.py
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
NUM_BLOCKS, HEADS, BS, CH = 8, 2, 4, 6  # HEADS per rank
PAGE = HEADS * BS * CH * 4
FULL = len(LAYERS) * PAGE
KEYS = block_keys(list(range(6 * BS)), BS)


@dataclass
class Rank:
    shard: Shard
    stored: list[torch.Tensor]
    """This rank's shard of blocks 0-2, as stored."""
    pool: StagingPool
    channel: DecodeSideChannel
    target: NixlAgent
    p_kv: dict[str, torch.Tensor]
    p_worker: KVWorker
    prefill: PrefillRemote
    d_worker: KVWorker


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[tuple[str, list[Rank]]]:
    base = free_ports(TP)
    out = []
    for r in range(TP):
        shard = Shard(r, TP)
        store = BlockStore(tmp_path / "store", FULL, is_durable=False)
        g = torch.Generator().manual_seed(10 + r)
        stored = []
        for key in KEYS[:3]:
            block = torch.randint(0, 255, (FULL,), dtype=torch.uint8, generator=g)
            store.put(shard.key(key), block.numpy().data)
            stored.append(block)
        pool = StagingPool(SlotPool(None, FULL, 6))
        target = NixlAgent(agent_name(f"decode-rank{r}"), progress_thread=True)
        target.register([(pool.base, pool.num_slots * FULL)])
        channel = DecodeSideChannel(shard.side_channel(f"127.0.0.1:{base}"), pool, store,
                                    target.metadata(), target.connect)
        p_kv = {n: torch.zeros(NUM_BLOCKS, HEADS, BS, CH, device=KV_DEVICE) for n in LAYERS}
        p_worker = KVWorker(store, LAYERS, PAGE, shard=shard)
        out.append(Rank(shard, stored, pool, channel, target, p_kv, p_worker,
                        PrefillRemote(p_worker, p_kv), KVWorker(store, LAYERS, PAGE,
                                                                shard=shard)))
    yield f"127.0.0.1:{base}", out
    for rank in out:
        rank.prefill.close()
        rank.channel.close()
        rank.target.close()
        rank.pool.close()


def page_of(block: torch.Tensor, layer: int) -> torch.Tensor:
    return block[layer * PAGE:(layer + 1) * PAGE].view(torch.float32).view(HEADS, BS, CH)


def same(page: torch.Tensor, expected: torch.Tensor) -> bool:
    return torch.equal(page.cpu().contiguous().view(torch.uint8),
                       expected.cpu().contiguous().view(torch.uint8))


def test_each_rank_pulls_and_pushes_its_own_shard(ranks: tuple[str, list[Rank]]) -> None:
    de, rs = ranks
    assert [r.channel.address for r in rs] == [de, de.rsplit(":", 1)[0] + ":" + str(
        int(de.rsplit(":", 1)[1]) + 1)]
    tails = [torch.randint(0, 255, (FULL,), dtype=torch.uint8) for _ in rs]
    plan = StepPlan(  # every rank gets the same plan: rank-agnostic keys, the instance's side
        remote_loads=[RemoteLoad("x", de, BlockTransfer("r", 0, (5, 1, 6), tuple(KEYS[:3])))],
        pushes=[Push("x", de, "r", (3,), (5, 1, 6, 2), hit_blocks=3)])
    for r, tail in zip(rs, tails, strict=True):
        r.p_worker.bind(plan)
        r.prefill.bind(plan)
        r.prefill.request_stages()
        r.p_worker.load()
        r.prefill.load()
        for i, name in enumerate(LAYERS):
            r.prefill.inject(name)
            r.p_kv[name][2].copy_(page_of(tail, i))  # "attention" computes block 3
            r.p_worker.capture(name, r.p_kv[name])
            r.prefill.capture(name)
        r.prefill.flush()
        r.p_worker.flush()
        assert r.p_worker.take_load_errors() == set()
        for i, name in enumerate(LAYERS):
            for block_id, block in zip((5, 1, 6), r.stored, strict=True):
                assert same(r.p_kv[name][block_id], page_of(block, i))
    for r, tail in zip(rs, tails, strict=True):  # each decode rank: its own four blocks
        kv = {n: torch.zeros(NUM_BLOCKS, HEADS, BS, CH, device=KV_DEVICE) for n in LAYERS}
        remote = DecodeRemote(r.d_worker, r.pool)
        load = StepPlan(xfer_loads=[XferLoad("x", "r", 0, (0, 3, 4, 7))])
        r.d_worker.bind(load)
        remote.bind(load)
        r.d_worker.load()
        remote.load()
        for name in LAYERS:
            r.d_worker.inject(name, kv[name])
            remote.inject(name, kv[name])
        remote.flush()
        assert r.d_worker.take_load_errors() == set()
        for i, name in enumerate(LAYERS):
            for block_id, block in zip((0, 3, 4, 7), [*r.stored, tail], strict=True):
                assert same(kv[name][block_id], page_of(block, i))


def test_a_gpu_ranks_paged_kv_is_registered_as_vram_on_its_device() -> None:
    """What a prefill rank registers for its pulls and pushes: each layer's span (from block
    0's page to the last) as VRAM on the tensor's own CUDA device, not DRAM on device 0. No
    GPU here: a stand-in with a CUDA tensor's attributes, and NIXL's registration call
    recorded instead of made (NIXL's, not ours)."""
    from types import SimpleNamespace

    agent = NixlAgent(agent_name("vram-test"))
    calls: list[tuple[list[tuple[int, int, int, str]], str]] = []
    agent.agent.register_memory = lambda descs, mem_type: calls.append((descs, mem_type))
    layer = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=5),
                            data_ptr=lambda: 0x7F0000000000, numel=lambda: 4096,
                            element_size=lambda: 2)
    agent.register_tensors([layer])
    assert calls == [([(0x7F0000000000, 8192, 5, "")], "VRAM")]
    agent.close()


def test_a_stale_pushed_slot_is_a_load_error_not_wrong_kv(
        ranks: tuple[str, list[Rank]]) -> None:
    """The prefill worker commits each pushed block's digest; a slot whose bytes are not what
    it wrote (a WRITE that raced the GPU, a slot reused) fails the decode worker's check, and
    the request is recomputed from that block."""
    de, (r, _) = ranks
    computed = [torch.randint(0, 255, (FULL,), dtype=torch.uint8) for _ in range(2)]
    plan = StepPlan(pushes=[Push("y", de, "q", (0, 1), (3, 4), hit_blocks=0)])
    r.p_worker.bind(plan)
    r.prefill.bind(plan)
    for i, name in enumerate(LAYERS):
        for block_id, block in zip((3, 4), computed, strict=True):
            r.p_kv[name][block_id].copy_(page_of(block, i))
        r.prefill.capture(name)
    r.prefill.flush()
    assert r.p_worker.counters.pushed_blocks == 2
    (_, second) = r.pool.lookup(r.shard.xfer("y"), [0, 1])
    assert second is not None
    r.pool.view(second)[PAGE + 17] ^= 0xFF  # layer 1's page of block 1, after the commit
    kv = {n: torch.zeros(NUM_BLOCKS, HEADS, BS, CH, device=KV_DEVICE) for n in LAYERS}
    remote = DecodeRemote(r.d_worker, r.pool)
    load = StepPlan(xfer_loads=[XferLoad("y", "q", 0, (6, 7))])
    r.d_worker.bind(load)
    remote.bind(load)
    remote.load()
    for name in LAYERS:
        remote.inject(name, kv[name])
    assert r.d_worker.take_load_errors() == {7}  # block 0 loads, block 1 is recomputed
    assert r.d_worker.counters.remote_errors == 1
    for i, name in enumerate(LAYERS):
        assert same(kv[name][6], page_of(computed[0], i))
        assert not kv[name][7].any()
