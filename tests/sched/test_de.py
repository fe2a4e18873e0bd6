"""Two-level DE scheduling and its round-robin baseline, hand-computed cases."""

from __future__ import annotations

import pytest

from dualpath.core.errors import SpecError
from dualpath.sched.de import (
    de_global_drain,
    de_global_drain_round_robin,
    de_group_fetch,
    de_group_fetch_round_robin,
    de_least_loaded_group,
)
from dualpath.sched.params import HbmNeed, PathMode, SchedulerParams
from dualpath.sched.types import EngineReport, Role, WaitingRequest

BIG = 10**12


def params(**kw: object) -> SchedulerParams:
    # 1 byte per token and prompt-only HBM make HBM needs equal to prompt lengths.
    base: dict[str, object] = {"alpha_tokens": 0, "beta_tokens": 0, "kv_bytes_per_token": 1.0,
                               "hbm_need": HbmNeed.PROMPT}
    base.update(kw)
    return SchedulerParams(**base)  # type: ignore[arg-type]


def de(engine: int, seq: int, tok: int, free: int = BIG, node: int | None = None) -> EngineReport:
    return EngineReport(engine, engine if node is None else node, Role.DECODE, num_seqs=seq,
                        num_tokens=tok, read_q_tokens=0, free_hbm_bytes=free)


def req(i: int, prompt: int = 100, hit: int = 0, gen: int = 0) -> WaitingRequest:
    return WaitingRequest(i, prompt_tokens=prompt, hit_tokens=hit, gen_tokens=gen)


def engines(fetch: object) -> list[int]:
    return [a.engine_id for a in fetch.assignments]  # type: ignore[attr-defined]


def test_z_threshold_splits_high_and_low_token_engines() -> None:
    # tok 100 and 300; R = both requests (len 100 each): Z = 1.05 * (200 + 400) / 2 = 315.
    reports = [de(0, seq=5, tok=100), de(1, seq=0, tok=300)]
    f = de_group_fetch([req(0), req(1)], reports, params())
    assert f.num_r_set == 2
    assert abs(f.z_threshold_tokens - 315.0) < 1e-9
    # r0: e0 100+100=200 <= 315 (low), e1 300+100=400 > 315 (high): e0 despite its seq 5.
    # r1: e0 200+100=300 <= 315 still low: e0 again; e1 never gets one.
    assert engines(f) == [0, 0]


def test_minimum_seq_among_low_engines() -> None:
    reports = [de(0, seq=3, tok=0), de(1, seq=1, tok=0), de(2, seq=1, tok=0)]
    f = de_group_fetch([req(0), req(1), req(2)], reports, params())
    # Z = 1.05 * 300 / 3 = 105. r0: seq (3,1,1), all low: e1 (tie with e2 by id).
    # r1: seq (3,2,1): e2. r2: e1 and e2 would reach 200 > 105 (high), e0 0+100 is low: e0.
    assert engines(f) == [1, 2, 0]


def test_minimum_tok_when_no_low_engine() -> None:
    reports = [de(0, seq=0, tok=1000), de(1, seq=9, tok=900)]
    f = de_group_fetch([req(0, prompt=500)], reports, params())
    # Z = 1.05 * (500 + 1900) / 2 = 1260; 1000+500=1500 and 900+500=1400 are both high:
    # the minimum-tok engine e1 wins although e0 has the lower seq.
    assert abs(f.z_threshold_tokens - 1260.0) < 1e-9
    assert engines(f) == [1]


def test_hbm_is_never_oversubscribed_and_fetch_ends_at_first_misfit() -> None:
    reports = [de(0, 0, 0, free=250), de(1, 0, 0, free=150)]
    queue = [req(0, 100), req(1, 100), req(2, 100), req(3, 100)]
    f = de_group_fetch(queue, reports, params())
    # Total free 400 fits R = 4 requests, but per engine only 2 + 1 = 3 fit.
    assert f.num_r_set == 4
    assert f.num_assigned == 3
    used = {0: 0, 1: 0}
    for a in f.assignments:
        used[a.engine_id] += a.hbm_bytes
    assert used[0] <= 250 and used[1] <= 150


def test_hbm_need_includes_generation_by_default() -> None:
    p = SchedulerParams(alpha_tokens=0, beta_tokens=0, kv_bytes_per_token=2.5)
    assert p.hbm_bytes(req(0, prompt=100, gen=3)) == 258  # ceil(103 * 2.5)
    f = de_group_fetch([req(0, prompt=100, gen=3)], [de(0, 0, 0, free=257)], p)
    assert f.num_assigned == 0


def test_r_set_stop_versus_skip_changes_z() -> None:
    reports = [de(0, 0, 0, free=300)]
    queue = [req(0, 100), req(1, 500), req(2, 100)]
    stop = de_group_fetch(queue, reports, params())
    skip = de_group_fetch(queue, reports, params(r_set_stops_at_first_misfit=False))
    assert (stop.num_r_set, skip.num_r_set) == (1, 2)
    assert abs(stop.z_threshold_tokens - 105.0) < 1e-9
    assert abs(skip.z_threshold_tokens - 210.0) < 1e-9
    assert stop.num_assigned == skip.num_assigned == 1  # placement stays FIFO-head only


def test_global_drain_balances_group_load() -> None:
    loads = {0: 100, 1: 0}
    out = de_global_drain([req(i, prompt=60) for i in range(4)], loads, params())
    # loads (100, 0): g1 -> 60; 60 < 100: g1 -> 120; 100 < 120: g0 -> 160; g1 -> 180.
    assert [a.group_id for a in out] == [1, 1, 0, 1]
    assert loads == {0: 100, 1: 0}
    rr, nxt = de_global_drain_round_robin([req(i) for i in range(3)], [4, 7], start=1)
    assert [a.group_id for a in rr] == [7, 4, 7] and nxt == 0


def test_pe_first_order_chooses_the_path_at_de_fetch() -> None:
    reports = [de(0, 0, 0, node=3)]
    f = de_group_fetch([req(0, prompt=200, hit=128)], reports, params(path_mode=PathMode.DUAL),
                       pe_node_of={0: 1}, read_q_tokens_by_node={1: 500})
    plan = f.assignments[0].read
    assert plan is not None and plan.num_de_blocks == 2  # DE node 3 queue 0 < 500
    assert f.read_q_tokens_by_node[3] == 128 and f.read_q_tokens_by_node[1] == 500


def test_round_robin_de_respects_hbm() -> None:
    reports = [de(0, 0, 0, free=100), de(1, 0, 0, free=300)]
    f, nxt = de_group_fetch_round_robin([req(i) for i in range(5)], reports, params())
    assert engines(f) == [0, 1, 1, 1]
    assert nxt == 0


def test_is_validated_skips_only_the_report_checks() -> None:
    reports = [de(0, 2, 300, free=250), de(1, 0, 50, free=180), de(2, 1, 10, free=90)]
    queue = [req(i, prompt=40 + 30 * i) for i in range(6)]
    for stop in (True, False):
        p = params(r_set_stops_at_first_misfit=stop)
        assert de_group_fetch(queue, reports, p, is_validated=True) == de_group_fetch(
            queue, reports, p)
        assert de_group_fetch_round_robin(queue, reports, p, 2, is_validated=True) == (
            de_group_fetch_round_robin(queue, reports, p, 2))
    # A lazily consumed queue (the simulator passes a generator) decides the same.
    assert de_group_fetch(iter(queue), reports, params(), is_validated=True) == de_group_fetch(
        queue, reports, params())
    wrong_role = [EngineReport(0, 0, Role.PREFILL, 0, 0, 0, BIG)]
    with pytest.raises(SpecError, match="decode"):
        de_group_fetch([req(0)], wrong_role, params())
    assert de_group_fetch([req(0)], wrong_role, params(), is_validated=True).num_assigned == 1


def test_single_request_drain_matches_the_heap_path() -> None:
    # A one-element list takes the min() shortcut; an iterator takes the heap: same choice,
    # ties included (lower group id).
    for loads in ({0: 5, 1: 3, 2: 3}, {4: 0, 2: 0}, {7: 10}, {0: 9, 1: 8, 2: 9}):
        r = req(0, prompt=50)
        assert de_global_drain([r], loads, params()) == de_global_drain(iter([r]), loads,
                                                                        params())


def test_least_loaded_group_is_the_drain_choice_for_one_request() -> None:
    # Loads held by group index (the simulator's form): the same group as the drain picks.
    for loads in ([5, 3, 3], [0, 0], [10], [9, 8, 9, 8], [2, 1, 0, 0, 1]):
        (a,) = de_global_drain([req(0, prompt=50)], dict(enumerate(loads)), params())
        assert de_least_loaded_group(loads) == a.group_id
    with pytest.raises(SpecError, match="at least one DE group"):
        de_least_loaded_group([])


def test_sequence_cap_rules_out_full_engines_in_both_policies() -> None:
    # Engine 0 already holds 2 sequences, engine 1 holds 1; a cap of 2 leaves engine 1 one
    # slot, so only one of the three requests is placed (HBM alone would place all three).
    reports = [de(0, 2, 0), de(1, 1, 0)]
    queue = [req(i) for i in range(3)]
    assert len(engines(de_group_fetch(queue, reports, params()))) == 3
    assert engines(de_group_fetch(queue, reports, params(max_seqs_per_decode_engine=2))) == [1]
    # R (and so Z) counts only what the free slots can take: one here, three without a cap.
    assert de_group_fetch(queue, reports, params(max_seqs_per_decode_engine=2)).num_r_set == 1
    assert de_group_fetch(queue, reports, params()).num_r_set == 3
    f, _ = de_group_fetch_round_robin(queue, reports, params(max_seqs_per_decode_engine=3))
    assert engines(f) == [0, 1, 1]  # engine 0 reaches 3 after one, engine 1 after two
    f, _ = de_group_fetch_round_robin(queue, reports, params(max_seqs_per_decode_engine=2))
    assert engines(f) == [1]
    # The cap also applies when every engine is above Z (the minimum-tok fallback).
    high = [de(0, 5, 900), de(1, 1, 1000)]
    assert engines(de_group_fetch([req(0)], high, params(max_seqs_per_decode_engine=5))) == [1]
    with pytest.raises(SpecError, match="max_seqs_per_decode_engine"):
        params(max_seqs_per_decode_engine=-1)
    assert params().with_overrides(max_seqs_per_decode_engine=4.0).max_seqs_per_decode_engine == 4
