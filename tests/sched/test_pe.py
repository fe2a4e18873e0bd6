"""Algorithm 1 (PE scheduling) and its round-robin baseline, hand-computed cases."""

from __future__ import annotations

import pytest

from dualpath.core.errors import SpecError
from dualpath.sched.params import PathMode, SchedulerParams
from dualpath.sched.pe import pe_fetch, pe_fetch_round_robin
from dualpath.sched.types import EngineReport, Role, WaitingRequest

ALPHA, BETA = 1000, 500


def params(**kw: object) -> SchedulerParams:
    return SchedulerParams(alpha_tokens=ALPHA, beta_tokens=BETA, kv_bytes_per_token=1.0,
                           **kw)  # type: ignore[arg-type]


def pe(engine: int, node: int, tok: int, read_q: int = 0) -> EngineReport:
    return EngineReport(engine, node, Role.PREFILL, num_seqs=0, num_tokens=tok,
                        read_q_tokens=read_q, free_hbm_bytes=0)


def req(i: int, prompt: int = 100, hit: int = 64) -> WaitingRequest:
    return WaitingRequest(i, prompt_tokens=prompt, hit_tokens=hit, gen_tokens=10)


def chosen(fetch: object) -> list[int]:
    return [a.engine_id for a in fetch.assignments]  # type: ignore[attr-defined]


def test_overloaded_engine_never_receives_work_and_fetch_ends() -> None:
    # e0 is overloaded (tok > beta); e1 sits exactly at beta, so it is still eligible.
    reports = [pe(0, 0, tok=BETA + 1), pe(1, 0, tok=BETA)]
    f = pe_fetch([req(i) for i in range(5)], reports, params())
    # e1 takes the head (tok 500 -> 600 > beta), then every engine is overloaded.
    assert chosen(f) == [1]
    assert f.num_assigned == 1


def test_category_two_wins_over_three_despite_higher_tok() -> None:
    # e0: long read queue (read_q > alpha), tok 0; e1: short read queue, tok 300.
    reports = [pe(0, 0, tok=0, read_q=ALPHA + 1), pe(1, 1, tok=300, read_q=ALPHA)]
    f = pe_fetch([req(0), req(1)], reports, params())
    # e1 takes both (300 -> 400 -> 500, still <= beta); e0 only after e1 is overloaded.
    assert chosen(f) == [1, 1]
    f = pe_fetch([req(i) for i in range(4)], reports, params())
    assert chosen(f) == [1, 1, 1, 0]  # e1 reaches 600 > beta after the third


def test_minimum_tok_with_update_after_each_assignment() -> None:
    reports = [pe(0, 0, tok=0), pe(1, 0, tok=50), pe(2, 0, tok=0)]
    f = pe_fetch([req(i, prompt=40, hit=0) for i in range(5)], reports, params())
    # toks: (0,50,0) -> e0:40 -> e2:40 -> e0:80 (tie 40/40 broken by engine id) -> e2:80
    # -> e1:90
    assert chosen(f) == [0, 2, 0, 2, 1]


def test_assignments_are_a_fifo_prefix() -> None:
    reports = [pe(0, 0, tok=0), pe(1, 1, tok=0, read_q=5000)]
    queue = [req(i, prompt=200, hit=0) for i in (7, 3, 9, 1, 4)]
    f = pe_fetch(queue, reports, params())
    ids = [a.request_id for a in f.assignments]
    assert ids == [7, 3, 9, 1, 4][: len(ids)]
    # e0 (short) takes 3 (0->600>beta after the 3rd), then e1 (long) takes 3 more: 5 in all.
    assert chosen(f) == [0, 0, 0, 1, 1]


def test_read_q_update_within_fetch_moves_node_to_category_three() -> None:
    # Node 0 holds e0 (tok 0) and e1 (tok 10); node 1 holds e2 (tok 100). Node 0's queue is
    # just under alpha. DEs are on node 9 with a long queue, so reads go to the PE side.
    reports = [pe(0, 0, 0, read_q=ALPHA - 10), pe(1, 0, 10, read_q=ALPHA - 10),
               pe(2, 1, 100, read_q=0)]
    queue = [req(0, prompt=100, hit=64), req(1, prompt=100, hit=64)]
    de_node_of = {0: 9, 1: 9}
    others = {9: 10**6}
    f = pe_fetch(queue, reports, params(), de_node_of=de_node_of, read_q_tokens_by_node=others)
    # The first read (64 tokens) pushes node 0 over alpha: e1 drops to category 3, so the
    # second request goes to e2 (category 2) although e1 has the lower tok.
    assert chosen(f) == [0, 2]
    assert f.read_q_tokens_by_node[0] == ALPHA - 10 + 64
    assert f.read_q_tokens_by_node[1] == 64
    assert all(a.read is not None and a.read.num_pe_blocks == 1 for a in f.assignments)
    # With the paper's literal prose (no update within the fetch) e1 gets it.
    g = pe_fetch(queue, reports, params(update_read_q_within_fetch=False),
                 de_node_of=de_node_of, read_q_tokens_by_node=others)
    assert chosen(g) == [0, 1]
    # ... and the returned queues still carry both reads.
    assert g.read_q_tokens_by_node[0] == ALPHA - 10 + 128


def test_path_is_left_open_without_a_de() -> None:
    f = pe_fetch([req(0)], [pe(0, 0, 0)], params(path_mode=PathMode.DUAL))
    assert f.assignments[0].read is None
    assert f.read_q_tokens_by_node == {0: 0}


def test_inputs_are_not_changed_and_empty_queue() -> None:
    reports = [pe(0, 0, 0)]
    queue = [req(0)]
    others = {5: 7}
    pe_fetch(queue, reports, params(), de_node_of={0: 5}, read_q_tokens_by_node=others)
    assert others == {5: 7} and reports[0].num_tokens == 0
    assert pe_fetch([], reports, params()).num_assigned == 0


def test_bad_snapshot_is_rejected_with_a_named_field() -> None:
    with pytest.raises(SpecError, match="role"):
        pe_fetch([req(0)], [EngineReport(0, 0, Role.DECODE, 0, 0, 0, 0)], params())
    with pytest.raises(SpecError, match="read_q_tokens"):
        pe_fetch([req(0)], [pe(0, 0, 0, read_q=1), pe(1, 0, 0, read_q=2)], params())
    with pytest.raises(SpecError, match="engine_id"):
        pe_fetch([req(0)], [pe(0, 0, 0), pe(0, 0, 0)], params())


def test_round_robin_ignores_load_but_not_beta() -> None:
    reports = [pe(0, 0, tok=0), pe(1, 1, tok=BETA + 1, read_q=10**6), pe(2, 1, tok=400,
               read_q=10**6)]
    f, nxt = pe_fetch_round_robin([req(i) for i in range(4)], reports, params(), start=2)
    # from e2: e2 (400->500), e0 (100), [e1 overloaded] e2 (600), e0 (200)
    assert chosen(f) == [2, 0, 2, 0]
    assert nxt == 1
    f2, _ = pe_fetch_round_robin([req(i) for i in range(9)], reports, params())
    assert all(e != 1 for e in chosen(f2))


def test_negative_report_counter_is_rejected() -> None:
    with pytest.raises(SpecError, match=r"engine\[3\]\.num_tokens=-1"):
        EngineReport(3, 0, Role.PREFILL, 0, -1, 0, 0)


def test_is_validated_skips_only_the_report_checks() -> None:
    # Valid reports: the trusted path decides exactly what the checked path decides.
    reports = [pe(0, 0, tok=100, read_q=50), pe(1, 0, tok=0, read_q=50), pe(2, 1, tok=10)]
    queue = [req(i, prompt=300, hit=128) for i in range(6)]
    de_node_of = {i: 7 for i in range(6)}
    for mode in (PathMode.PE, PathMode.DUAL, PathMode.SPLIT):
        p = params(path_mode=mode)
        checked = pe_fetch(queue, reports, p, de_node_of=de_node_of,
                           read_q_tokens_by_node={7: 90})
        trusted = pe_fetch(queue, reports, p, de_node_of=de_node_of,
                           read_q_tokens_by_node={7: 90}, is_validated=True)
        assert trusted == checked
        rr = pe_fetch_round_robin(queue, reports, p, 1, de_node_of=de_node_of)
        assert pe_fetch_round_robin(queue, reports, p, 1, de_node_of=de_node_of,
                                    is_validated=True) == rr
    # Invalid reports (engine twice) are rejected unless the caller vouches for them.
    twice = [pe(0, 0, tok=0), pe(0, 0, tok=0)]
    with pytest.raises(SpecError, match="reported twice"):
        pe_fetch([req(0)], twice, params())
    assert pe_fetch([req(0)], twice, params(), is_validated=True).num_assigned == 1
