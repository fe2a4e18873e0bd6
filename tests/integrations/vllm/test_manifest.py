"""The contract between the vLLM connector and the router (`integrations.vllm.manifest`): shard
keys of tensor- and pipeline-parallel workers, and the stored-block rule the router counts by."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dualpath.core.blocks import block_keys
from dualpath.core.errors import SpecError
from dualpath.integrations.vllm.manifest import (
    MAX_WAVE,
    Shard,
    StoreManifest,
    read_manifests,
)
from dualpath.store import BlockStore

KEY = bytes(range(16))


def test_one_shard_keeps_the_block_key_and_names() -> None:
    one = Shard()
    assert one.key(KEY) == KEY and one.xfer("x1") == "x1"
    assert one.side_channel("10.0.0.2:5600") == "10.0.0.2:5600"


def test_every_rank_of_every_layout_has_keys_of_its_own() -> None:
    shards = [Shard(t, tp, p, pp) for tp, pp in ((1, 2), (2, 1), (2, 2), (4, 1), (8, 1))
              for p in range(pp) for t in range(tp)]
    keys = {s.key(KEY) for s in shards}
    assert len(keys) == len(shards) and KEY not in keys
    assert all(len(k) == len(KEY) for k in keys)
    assert Shard(1, 2).key(KEY) == Shard(1, 2).key(KEY)  # deterministic


def test_each_rank_has_its_own_transfer_and_side_channel() -> None:
    shards = [Shard(t, 2, p, 2) for p in range(2) for t in range(2)]
    assert [s.index for s in shards] == [0, 1, 2, 3]
    assert len({s.xfer("x1") for s in shards}) == 4
    assert [s.side_channel("d0:5600") for s in shards] == [
        "d0:5600", "d0:5601", "d0:5602", "d0:5603"]
    with pytest.raises(SpecError, match="side_channel"):
        Shard(1, 2).side_channel("d0")


def test_a_rank_outside_its_group_is_refused() -> None:
    with pytest.raises(SpecError, match="tp_rank"):
        Shard(2, 2)
    with pytest.raises(SpecError, match="pp_rank"):
        Shard(0, 1, -1, 2)


def test_the_router_counts_a_block_once_its_last_shard_is_stored(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, 8, is_durable=False)
    manifest = StoreManifest(namespace=bytes(16).hex(), model="m", block_size=4,
                             full_block_bytes=8, tp_size=2)
    tokens = list(range(13))  # 3 full blocks may hit
    keys = block_keys(tokens, 4, manifest.namespace_bytes)
    for key in keys[:2]:
        store.put(Shard(0, 2).key(key), bytes(8))
    assert manifest.hit_blocks(tokens, store.contains) == 0  # rank 1 has none yet
    for key in keys[:3]:
        store.put(Shard(1, 2).key(key), bytes(8))
    assert manifest.hit_blocks(tokens, store.contains) == 3
    assert manifest.stored_key(keys[0]) == Shard.last(2).key(keys[0])


@pytest.mark.parametrize("stat_s", [0.0, 1e-4])
@pytest.mark.parametrize("gap", [None, 0, 1, 15, 16, 47, 48, 300, 598])
def test_stored_prefix_checked_in_waves_counts_as_the_walk(gap: int | None,
                                                          stat_s: float) -> None:
    # Blocks stored from 0 with one gap (and stored again after it): the count in waves
    # (one by one where checks are fast, on threads where each is a 0.1 ms round trip) stops
    # at the gap as the one-by-one walk does, and checks at most a wave past it.
    manifest = StoreManifest(namespace=bytes(16).hex(), model="m", block_size=1,
                             full_block_bytes=8)
    tokens = list(range(600))
    keys = block_keys(tokens, 1, manifest.namespace_bytes)
    stored = {manifest.stored_key(k) for i, k in enumerate(keys) if i != gap}
    asked: list[bytes] = []

    def is_stored(key: bytes) -> bool:
        asked.append(key)
        time.sleep(stat_s)
        return key in stored
    walk = manifest.hit_blocks(tokens, lambda k: k in stored)
    assert walk == (599 if gap is None else gap)
    with ThreadPoolExecutor(8) as threads:
        assert manifest.hit_blocks(tokens, is_stored, threads) == walk
    assert len(asked) == len(set(asked)) <= walk + MAX_WAVE


def test_the_parallelism_round_trips_and_old_manifests_read_as_one_shard(
        tmp_path: Path) -> None:
    m = StoreManifest(namespace="ab" * 16, model="m", block_size=16, full_block_bytes=64,
                      tp_size=4, pp_size=2)
    m.write(tmp_path)
    assert read_manifests(tmp_path) == [m]
    path = m.write(tmp_path)
    raw = json.loads(path.read_text())
    del raw["tp_size"], raw["pp_size"]
    path.write_text(json.dumps(raw))
    (old,) = read_manifests(tmp_path)
    assert (old.tp_size, old.pp_size) == (1, 1) and old.stored_key(KEY) == KEY
