"""Read-path choice: PE only, the shorter queue (paper), and split (ours)."""

from __future__ import annotations

import pytest

from dualpath.core.errors import SpecError
from dualpath.sched.params import PathMode
from dualpath.sched.path import choose_read_path, plan_read
from dualpath.sched.types import ReadSide

BS = 64


def test_dual_picks_the_shorter_queue_and_updates_it() -> None:
    queues = {1: 1000, 2: 200}
    plan = choose_read_path(PathMode.DUAL, 5 * BS, 1, 2, queues, BS)
    assert plan.side is ReadSide.DE and plan.num_de_blocks == 5
    assert queues == {1: 1000, 2: 200 + 5 * BS}
    plan = choose_read_path(PathMode.DUAL, 2 * BS, 1, 2, {1: 10, 2: 11}, BS)
    assert plan.side is ReadSide.PE


def test_dual_tie_goes_to_the_configured_side() -> None:
    assert plan_read(PathMode.DUAL, BS, 1, 2, 7, 7, BS).side is ReadSide.PE
    assert plan_read(PathMode.DUAL, BS, 1, 2, 7, 7, BS, tie_side=ReadSide.DE).side is ReadSide.DE


def test_pe_mode_always_reads_on_the_pe_side() -> None:
    queues = {1: 10**9, 2: 0}
    plan = choose_read_path(PathMode.PE, 3 * BS, 1, 2, queues, BS)
    assert plan.side is ReadSide.PE and queues[1] == 10**9 + 3 * BS and queues[2] == 0


def test_split_equalises_drain_and_conserves_blocks() -> None:
    # q_p = 0, q_d = 2 blocks, h = 10 blocks: x = (2 + 10 - 0) / 2 = 6 blocks on the PE side.
    queues = {1: 0, 2: 2 * BS}
    plan = choose_read_path(PathMode.SPLIT, 10 * BS, 1, 2, queues, BS)
    assert (plan.num_pe_blocks, plan.num_de_blocks) == (6, 4)
    assert queues == {1: 6 * BS, 2: 6 * BS}
    assert sorted([*plan.pe_blocks, *plan.de_blocks]) == list(range(10))
    # One side far behind: everything goes to the other, as in dual mode.
    far = plan_read(PathMode.SPLIT, 4 * BS, 1, 2, 100 * BS, 0, BS)
    assert far.side is ReadSide.DE
    # Unequal storage NICs: a PE side twice as fast takes two thirds of an even start.
    fast = plan_read(PathMode.SPLIT, 9 * BS, 1, 2, 0, 0, BS, pe_read_bytes_per_s=2.0,
                     de_read_bytes_per_s=1.0)
    assert fast.num_pe_blocks == 6


def test_no_hit_reads_nothing_and_unaligned_hit_is_rejected() -> None:
    queues = {1: 5, 2: 6}
    plan = choose_read_path(PathMode.SPLIT, 0, 1, 2, queues, BS)
    assert plan.num_hit_blocks == 0 and queues == {1: 5, 2: 6}
    with pytest.raises(SpecError, match="hit_tokens"):
        plan_read(PathMode.DUAL, 65, 1, 2, 0, 0, BS)
