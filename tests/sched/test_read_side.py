"""The read-side choices the paper leaves open (`sched.path.ReadSideChooser`): the `balanced` tie
rule's split in proportion to the node counts, the round-robin family's seeded queue-blind
coin, and the defaults (balanced ties, the coin for the round-robin family), through the
`Scheduler`."""

from __future__ import annotations

import pytest

from dualpath.core.errors import SpecError
from dualpath.sched import pe as pe_policy
from dualpath.sched.params import (
    DEFAULT_RR_READ_SIDE,
    DEFAULT_TIE_SIDE,
    HbmNeed,
    PathMode,
    RRReadSide,
    SchedulerParams,
    TieSide,
)
from dualpath.sched.path import ReadSideChooser
from dualpath.sched.scheduler import Scheduler
from dualpath.sched.types import EngineReport, ReadSide, Role, WaitingRequest

BIG = 10**12
BS = 64


def params(**kw: object) -> SchedulerParams:
    base: dict[str, object] = {"alpha_tokens": 10**9, "beta_tokens": 10**9,
                               "kv_bytes_per_token": 1.0, "hbm_need": HbmNeed.PROMPT,
                               "block_size_tokens": BS, "path_mode": PathMode.DUAL}
    base.update(kw)
    return SchedulerParams(**base)  # type: ignore[arg-type]


def test_defaults_are_balanced_ties_and_the_round_robin_coin() -> None:
    p = params()
    assert p.dual_tie_side is TieSide.BALANCED is DEFAULT_TIE_SIDE
    assert p.rr_read_side is RRReadSide.RANDOM is DEFAULT_RR_READ_SIDE
    c = ReadSideChooser(p, is_round_robin=False, num_pe_nodes=2, num_de_nodes=4)
    assert [c.side(0, 0) for _ in range(6)].count(ReadSide.DE) == 4  # 4 of 6 ties to DE
    assert c.side(5, 3) is ReadSide.DE and c.side(3, 5) is ReadSide.PE
    assert (c.num_ties, c.num_ties_de) == (6, 4)
    rr = ReadSideChooser(p, is_round_robin=True, num_pe_nodes=2, num_de_nodes=4)
    blind = [rr.side(10**6, 0) for _ in range(200)]  # queue-blind: a far longer PE queue
    assert 0.35 < blind.count(ReadSide.PE) / len(blind) < 0.65 and rr.num_ties == 0


def test_fixed_sides_pe_and_the_queue_rule() -> None:
    p = params(dual_tie_side=TieSide.PE, rr_read_side=RRReadSide.QUEUE)
    for is_rr in (False, True):
        c = ReadSideChooser(p, is_round_robin=is_rr, num_pe_nodes=2, num_de_nodes=4)
        assert [c.side(0, 0) for _ in range(5)] == [ReadSide.PE] * 5
        assert c.side(5, 3) is ReadSide.DE and c.side(3, 5) is ReadSide.PE
        assert (c.num_ties, c.num_ties_de) == (5, 0)


@pytest.mark.parametrize(("num_pe", "num_de"), [(2, 4), (1, 2), (2, 1), (3, 5), (1, 1)])
def test_balanced_ties_split_exactly_by_node_count(num_pe: int, num_de: int) -> None:
    c = ReadSideChooser(params(dual_tie_side=TieSide.BALANCED), False, num_pe, num_de)
    sides = []
    for n in range(1, 601):
        sides.append(c.side(7, 7))
        # After n ties the DE side has taken exactly floor(n * D / (P + D)) of them.
        assert sides.count(ReadSide.DE) == n * num_de // (num_pe + num_de)
    assert c.num_ties == 600 and c.num_ties_de == sides.count(ReadSide.DE)
    again = ReadSideChooser(params().with_overrides(dual_tie_side="balanced"), False, num_pe,
                            num_de)
    assert [again.side(0, 0) for _ in range(600)] == sides  # deterministic, no RNG


def test_balanced_counts_only_ties() -> None:
    c = ReadSideChooser(params(dual_tie_side=TieSide.BALANCED), False, 1, 2)
    # Unequal queues follow the shorter-queue rule and leave the counter alone.
    assert [c.side(0, 1), c.side(1, 0), c.side(0, 0), c.side(9, 1), c.side(0, 0),
            c.side(0, 0)] == [ReadSide.PE, ReadSide.DE, ReadSide.PE, ReadSide.DE, ReadSide.DE,
                              ReadSide.DE]
    assert (c.num_ties, c.num_ties_de) == (3, 2)


def test_balanced_without_the_scheduler_state_takes_the_first_tie() -> None:
    p = params(dual_tie_side=TieSide.BALANCED)
    q = [WaitingRequest(0, 256, 128, 0)]
    reports = [EngineReport(0, 0, Role.PREFILL, 0, 0, 0, BIG)]
    # Stateless: a fresh counter's first tie, PE (for any node counts: D < P + D).
    fetch = pe_policy.pe_fetch(q, reports, p, de_node_of={0: 1})
    read = fetch.assignments[0].read
    assert read is not None and read.num_pe_blocks == read.num_hit_blocks > 0
    c = ReadSideChooser(p, False, 1, 2)
    fetch = pe_policy.pe_fetch(q, reports, p, de_node_of={0: 1}, sides=c)
    assert fetch.assignments[0].read is not None and c.num_ties == 1
    de = params(dual_tie_side=TieSide.DE)
    read = pe_policy.pe_fetch(q, reports, de, de_node_of={0: 1}).assignments[0].read
    assert read is not None and read.num_de_blocks == read.num_hit_blocks > 0


def _sides_through_scheduler(s: Scheduler, n: int, pe_read_q: int = 0) -> list[ReadSide]:
    """DE first: one request at a time through drain, de_fetch and pe_fetch, from read queues
    `pe_read_q` (the PE node) and 0 (the DE nodes); the side each read went to."""
    out = []
    for i in range(n):
        s.submit(WaitingRequest(i, 256, 128, 0))
        (moved,) = s.drain([0] * s.num_de_groups)
        g = moved.group_id
        s.de_fetch(g, [EngineReport(10 + g, 1 + g, Role.DECODE, 0, 0, 0, BIG)])
        fetch = s.pe_fetch(0, [EngineReport(0, 0, Role.PREFILL, 0, 0, pe_read_q, BIG)], {})
        (a,) = fetch.assignments
        assert a.read is not None and a.read.side is not None
        out.append(a.read.side)
    return out


def test_scheduler_balanced_ties_follow_its_read_nodes() -> None:
    s = Scheduler(params(dual_tie_side=TieSide.BALANCED), num_de_groups=4, read_nodes=(2, 4))
    sides = _sides_through_scheduler(s, 300)
    assert sides.count(ReadSide.DE) == 200  # 4 / 6 of 300, every read a tie (empty queues)
    to_pe = Scheduler(params(dual_tie_side=TieSide.PE), num_de_groups=4, read_nodes=(2, 4))
    assert _sides_through_scheduler(to_pe, 30) == [ReadSide.PE] * 30
    default = Scheduler(params(), num_de_groups=4, read_nodes=(2, 4))
    assert _sides_through_scheduler(default, 30).count(ReadSide.DE) == 20


def test_round_robin_random_is_seeded_and_about_half_half() -> None:
    p = params(rr_read_side=RRReadSide.RANDOM)
    runs = {seed: _sides_through_scheduler(
        Scheduler(p, num_de_groups=2, is_round_robin=True, read_nodes=(1, 2), seed=seed), 2000)
        for seed in (0, 1)}
    again = _sides_through_scheduler(
        Scheduler(p, num_de_groups=2, is_round_robin=True, read_nodes=(1, 2), seed=0), 2000)
    assert again == runs[0] and runs[1] != runs[0]
    for sides in runs.values():
        assert 0.45 < sides.count(ReadSide.DE) / len(sides) < 0.55
    # Queue-blind: a PE read queue far longer than the DE's still gets about half the reads.
    blind = _sides_through_scheduler(
        Scheduler(p, num_de_groups=2, is_round_robin=True, seed=0), 2000, pe_read_q=10**6)
    assert 0.45 < blind.count(ReadSide.PE) / len(blind) < 0.55


def test_random_applies_to_the_round_robin_family_only() -> None:
    p = params(rr_read_side=RRReadSide.RANDOM, dual_tie_side=TieSide.PE)
    dualpath = Scheduler(p, num_de_groups=2, is_round_robin=False, seed=0)
    assert _sides_through_scheduler(dualpath, 50, pe_read_q=10**6) == [ReadSide.DE] * 50
    assert _sides_through_scheduler(dualpath, 10) == [ReadSide.PE] * 10  # ties: PE


def test_overrides_take_the_values_as_strings() -> None:
    p = params().with_overrides(dual_tie_side="balanced", rr_read_side="random")
    assert p.dual_tie_side is TieSide.BALANCED and p.rr_read_side is RRReadSide.RANDOM
    with pytest.raises(SpecError, match="dual_tie_side"):
        params().with_overrides(dual_tie_side="left")
    with pytest.raises(SpecError, match="rr_read_side"):
        params().with_overrides(rr_read_side="alternate")
