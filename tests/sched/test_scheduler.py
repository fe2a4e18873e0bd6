"""The one stateful scheduler (`sched.scheduler`): where requests wait, the charges its phase 1
balances, its round-robin cursors, both assignment orders and cancel, hand-computed."""

from __future__ import annotations

import pytest

from dualpath.core.errors import SpecError
from dualpath.sched.params import AssignmentOrder, HbmNeed, PathMode, SchedulerParams, TokCharge
from dualpath.sched.scheduler import Scheduler, Stage
from dualpath.sched.types import EngineReport, Role, WaitingRequest

BIG = 10**12
BS = 64


def params(**kw: object) -> SchedulerParams:
    # 1 byte per token and prompt-only HBM: a request's HBM need is its prompt length.
    base: dict[str, object] = {"alpha_tokens": 10**9, "beta_tokens": 10**9,
                               "kv_bytes_per_token": 1.0, "hbm_need": HbmNeed.PROMPT,
                               "block_size_tokens": BS, "path_mode": PathMode.DUAL}
    base.update(kw)
    return SchedulerParams(**base)  # type: ignore[arg-type]


def de(engine: int, node: int, tok: int = 0, free: int = BIG, read_q: int = 0) -> EngineReport:
    return EngineReport(engine, node, Role.DECODE, 0, tok, read_q, free)


def pe(engine: int, node: int = 0, tok: int = 0, read_q: int = 0) -> EngineReport:
    return EngineReport(engine, node, Role.PREFILL, 0, tok, read_q, BIG)


def req(i: int, prompt: int = 256, hit: int = 128) -> WaitingRequest:
    return WaitingRequest(i, prompt, hit, 0)


def test_de_first_request_passes_global_private_pe_and_gets_its_read_planned() -> None:
    s = Scheduler(params(), num_de_groups=2)
    assert s.submit(req(0)) is Stage.DE_GLOBAL
    assert s.num_global == 1 and s.num_waiting == 1
    (moved,) = s.drain([0, 0])
    assert (moved.request_id, moved.group_id) == (0, 0)
    assert s.num_private(0) == 1 and s.private_tokens == [256, 0]
    d = s.de_fetch(0, [de(2, node=1), de(3, node=1)])
    assert [(a.request_id, a.engine_id) for a in d.assignments] == [(0, 2)]
    assert d.assignments[0].read is None  # the PE is not known yet
    assert s.private_tokens == [0, 0] and s.num_pe_waiting == 1
    # The DE node's queue is shorter: the dual-path rule reads there.
    p = s.pe_fetch(0, [pe(0, read_q=1000)], {1: 0})
    (a,) = p.assignments
    assert a.engine_id == 0 and a.read is not None
    assert (a.read.pe_node_id, a.read.de_node_id, a.read.num_pe_blocks) == (0, 1, 0)
    assert s.num_waiting == 0


def test_phase_one_counts_what_waits_in_each_private_queue() -> None:
    # Equal reported loads: the first request goes to group 0; its charge in group 0's
    # private queue sends the second to group 1, then the third to group 0 again (256 < 512).
    s = Scheduler(params(), num_de_groups=2)
    got = []
    for i, prompt in enumerate((256, 512, 256)):
        s.submit(req(i, prompt=prompt))
        got += [g.group_id for g in s.drain([0, 0])]
    assert got == [0, 1, 0] and s.private_tokens == [512, 512]


def test_the_private_charge_is_de_tok_charge() -> None:
    s = Scheduler(params(de_tok_charge=TokCharge.MISS), num_de_groups=1)
    s.submit(req(0, prompt=256, hit=192))
    s.drain([0])
    assert s.private_tokens == [64]
    assert s.de_charge(req(0, prompt=256, hit=192)) == 64


def test_a_batch_drained_at_once_balances_like_one_by_one() -> None:
    s = Scheduler(params(), num_de_groups=2)
    for i, prompt in enumerate((256, 512, 256)):
        s.submit(req(i, prompt=prompt))
    assert [g.group_id for g in s.drain([0, 100])] == [0, 1, 0]
    assert s.num_global == 0 and s.drain([0, 0]) == ()


def test_round_robin_cursors_persist_across_calls_and_per_group() -> None:
    s = Scheduler(params(), num_de_groups=2, is_round_robin=True)
    groups = []
    for i in range(3):
        s.submit(req(i))
        groups += [g.group_id for g in s.drain([0, 10**6])]  # loads are ignored
    assert groups == [0, 1, 0]
    group0 = [de(2, node=1), de(3, node=1)]
    assert [a.engine_id for a in s.de_fetch(0, group0).assignments] == [2, 3]
    assert [a.engine_id for a in s.de_fetch(1, [de(4, node=2), de(5, node=2)])
            .assignments] == [4]
    # PE cursor: each PE group keeps its own.
    pes = [pe(0), pe(1)]
    first = s.pe_fetch(7, pes, {1: 0, 2: 0}).assignments
    assert [a.engine_id for a in first] == [0, 1, 0]
    for i in range(3, 5):
        s.submit(req(i))
    assert [(g.request_id, g.group_id) for g in s.drain([0, 0])] == [(3, 1), (4, 0)]
    # Group 1's cursor moved past engine 4, group 0's wrapped around to engine 2.
    assert [a.engine_id for a in s.de_fetch(1, [de(4, node=2), de(5, node=2)])
            .assignments] == [5]
    assert [a.engine_id for a in s.de_fetch(0, group0).assignments] == [2]
    assert [a.engine_id for a in s.pe_fetch(7, pes, {1: 0, 2: 0}).assignments] == [1, 0]


def test_a_fetch_that_cannot_place_the_head_leaves_the_queue_as_it_was() -> None:
    s = Scheduler(params(), num_de_groups=1)
    s.submit(req(0, prompt=512))
    s.drain([0])
    assert s.de_fetch(0, [de(2, node=1, free=100)]).assignments == ()
    assert s.num_private(0) == 1 and s.de_head(0) == req(0, prompt=512)
    assert s.private_tokens == [512]


def test_pe_first_binds_the_pe_then_the_de_which_plans_the_read() -> None:
    s = Scheduler(params(assignment_order=AssignmentOrder.PE_FIRST), num_de_groups=1)
    assert s.submit(req(0)) is Stage.PE
    (a,) = s.pe_fetch(0, [pe(0, read_q=0)], None).assignments
    assert a.read is None and s.num_global == 1
    s.drain([0])
    (d,) = s.de_fetch(0, [de(2, node=1, read_q=1000)], {0: 0}).assignments
    assert d.read is not None and d.read.num_pe_blocks == 2  # the PE node's queue is shorter
    assert s.num_waiting == 0


def test_cancel_drops_from_every_queue_and_its_charge() -> None:
    s = Scheduler(params(), num_de_groups=1)
    for i in range(3):
        s.submit(req(i))
    assert s.cancel(0).stage is Stage.DE_GLOBAL
    s.drain([0])
    assert s.cancel(1).stage is Stage.DE_PRIVATE and s.private_tokens == [256]
    s.de_fetch(0, [de(2, node=1)])
    assert s.cancel(2).stage is Stage.PE
    assert s.num_waiting == 0
    assert s.pe_fetch(0, [pe(0)], {1: 0}).assignments == ()
    gone = s.cancel(2)
    assert not gone.was_waiting and gone.stage is None


def test_phase_one_needs_a_load_per_group() -> None:
    s = Scheduler(params(), num_de_groups=2)
    s.submit(req(0))
    with pytest.raises(SpecError, match="group_tokens"):
        s.drain([0])
    with pytest.raises(SpecError, match="num_de_groups"):
        Scheduler(params(), num_de_groups=0)
