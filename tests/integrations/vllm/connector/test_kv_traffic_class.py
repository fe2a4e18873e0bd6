"""The connector's KV traffic class, from its `kv_connector_extra_config`, reaches both ends
of its NIXL transfers (`WorkerSide`, what the connector builds per worker): the prefill
worker's agent (its UCX backend's parameters) and the decode node's staging service, a process
of its own (its UCX context listens where the class's TCP ports say, which only the backend's
settings can make it do), while the bytes still move; a bad value is refused naming its key."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("nixl", reason="nixl (UCX) is part of make setup")

from dualpath.core.blocks import block_keys
from dualpath.core.errors import SpecError
from dualpath.integrations.vllm.cluster.ports import free_port
from dualpath.integrations.vllm.connector.layout import Layout
from dualpath.integrations.vllm.connector.side_channel.service import spawn_side_channel
from dualpath.integrations.vllm.connector.step_plan import BlockTransfer, RemoteLoad
from dualpath.integrations.vllm.connector.worker_side import WorkerSide
from dualpath.integrations.vllm.manifest import Shard
from dualpath.store import BlockStore
from dualpath.transport.traffic_class import KVTrafficClass

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
NUM_BLOCKS, HEADS, BS, CH = 4, 2, 4, 6
PAGE = HEADS * BS * CH * 4
FULL = len(LAYERS) * PAGE
PORTS = (20032, 20047)
KV = KVTrafficClass(ib_sl=2, traffic_class=72, tcp_ports=PORTS)


class Extra:
    """vLLM's `KVTransferConfig` as the connector reads it."""

    def __init__(self, **extra: object) -> None:
        self.extra = extra

    def get_from_extra_config(self, key: str, default: object) -> object:
        return self.extra.get(key, default)


def listening_ports(pid: int) -> list[int]:
    """The TCP ports process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            m = re.match(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
        if m:
            inodes.add(m.group(1))
    ports = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[9] in inodes and f[3] == "0A":
                ports.append(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def test_both_ends_of_the_kv_transfers_carry_the_class(tmp_path: Path) -> None:
    store = BlockStore(tmp_path / "store", FULL, is_durable=False)
    key = block_keys(list(range(BS)), BS)[0]
    block = torch.randint(0, 255, (FULL,), dtype=torch.uint8)
    store.put(key, block.numpy().data)
    address = f"127.0.0.1:{free_port()}"
    layout = Layout(BS, LAYERS, PAGE, b"ns")
    extra = {"kv_ib_sl": 2, "kv_traffic_class": 72}
    decode = WorkerSide(store, layout, "decode", Extra(side_channel=address, staging_blocks=2,
                                                       **extra), Shard(), None, None, None)
    prefill_side = WorkerSide(store, layout, "prefill", Extra(**extra), Shard(), None, False,
                              None)
    try:
        kv = {n: torch.zeros(NUM_BLOCKS, HEADS, BS, CH) for n in LAYERS}
        prefill_side.register(kv)
        assert prefill_side.prefill is not None
        assert prefill_side.prefill.pull_whole(RemoteLoad("x", address, BlockTransfer(
            "r", 0, (1,), (key,)))) == 1
        assert torch.equal(kv[LAYERS[0]][1].contiguous().view(-1).view(torch.uint8),
                           block[:PAGE])
        assert prefill_side.prefill.peers.link.backend_params()["engine_config"] == \
            "IB_SL=2,IB_TRAFFIC_CLASS=72"
    finally:
        prefill_side.close()
        decode.close()


def test_the_staging_service_gets_the_class(tmp_path: Path) -> None:
    """Its UCX context listens inside the class's ports: only the backend's settings do that."""
    store = BlockStore(tmp_path / "store", FULL, is_durable=False)
    address = f"127.0.0.1:{free_port()}"
    proc, pool = spawn_side_channel(address, str(store.root), FULL, 2, None, None, "ns",
                                    traffic_class=KV)
    try:
        service = listening_ports(proc.pid)
        assert any(PORTS[0] <= p <= PORTS[1] for p in service), service
        pool.close()
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_bad_class_is_refused_naming_its_key(tmp_path: Path) -> None:
    store = BlockStore(tmp_path / "store", FULL, is_durable=False)
    with pytest.raises(SpecError, match="kv_connector_extra_config.kv_ib_sl"):
        WorkerSide(store, Layout(BS, LAYERS, PAGE, b"ns"), "prefill", Extra(kv_ib_sl=99),
                   Shard(), None, False, None)
