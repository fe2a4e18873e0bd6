"""`plan.storage_bound`: which resource bounds a cluster's turn rate, with one read path and two."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dualpath.core.cluster import ClusterSpec
from dualpath.core.hardware import hardware_preset
from dualpath.core.hf_config import model_from_hf_config
from dualpath.core.read_rate import StorageReadModel
from dualpath.plan.storage_bound import StorageBound, storage_bound

LLAMA = model_from_hf_config(Path(__file__).resolve().parents[1] / "fixtures" / "configs"
                             / "llama-70b.json")
H200 = hardware_preset("h200")


def _bound(p: int, d: int, hit: int, append: int = 256, gen: int = 200,
           read: StorageReadModel | None = None) -> StorageBound:
    one = np.array([hit + append], dtype=np.int64)
    return storage_bound(ClusterSpec(H200, LLAMA, p, d, 8), one, np.array([hit]),
                         np.array([gen]), read)


def test_reads_of_a_long_hit_bind_one_path_and_two_paths_lift_the_bound() -> None:
    b = _bound(1, 2, 32768)
    assert b.read_bytes_per_turn == 32768 * LLAMA.kv_bytes_per_token
    # One storage NIC of 100 GB/s per node; the prefill node's alone with one path.
    assert b.one_path.storage_turns_per_s == pytest.approx(100e9 / b.read_bytes_per_turn)
    assert b.one_path.binding == "storage" and b.gain > 1.5
    assert b.two_paths.turns_per_s == min(b.two_paths.storage_turns_per_s,
                                          b.prefill_turns_per_s, b.decode_turns_per_s)
    assert b.verdict().startswith("DualPath is worth it here")
    assert 0 < b.storage_wait_share(b.one_path) < 1 and b.is_line_rate


def test_a_slow_storage_system_binds_both_paths() -> None:
    b = _bound(1, 2, 32768, read=StorageReadModel(read_efficiency=0.1))
    assert b.two_paths.binding == "storage" and not b.is_line_rate
    assert b.verdict().startswith("DualPath is worth it")  # still 3x: both sides read
    tight = _bound(2, 1, 32768, read=StorageReadModel(read_efficiency=0.05))
    assert tight.two_paths.binding == "storage"


def test_no_reuse_gains_nothing_and_a_near_miss_says_so() -> None:
    none = _bound(1, 2, 0, append=4096)
    assert none.gain == 1.0 and none.one_path.binding != "storage"
    assert none.verdict().startswith("DualPath gains little here (1.00x): one read path keeps")
    # Two TP-8 prefill nodes' storage NICs fall just short of two decode engines.
    near = _bound(2, 2, 32768, append=213, gen=179)
    assert near.one_path.binding == "storage" and near.two_paths.binding == "decode"
    assert near.gain < 1.10 and "one read path nearly keeps up" in near.verdict()
