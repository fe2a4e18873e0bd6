"""The router's decisions (`integrations.vllm.router.policy.RoutePolicy`), without HTTP."""

from __future__ import annotations

import random

import pytest

from dualpath.core.errors import SpecError
from dualpath.integrations.vllm.router.policy import (
    InstanceMetrics,
    RoutePolicy,
    route_params,
)
from dualpath.sched.params import PathMode
from dualpath.sched.types import Role

BS = 4
KV = 10.0  # bytes per token


def policy(mode: str, num_prefill: int = 1, num_decode: int = 1, beta: float = 1e9,
           capacity: int | None = None) -> RoutePolicy:
    params, rr = route_params(mode, BS, KV, alpha_tokens=1e9, beta_tokens=beta)
    return RoutePolicy(params, num_prefill, num_decode, rr, capacity)


def place(p: RoutePolicy, rid: int, prompt: int = 40, hit: int = 4, gen: int = 0) -> None:
    p.submit(rid, prompt, hit, gen)


def assert_idle(p: RoutePolicy) -> None:
    assert p.num_waiting == 0
    assert all(v == 0 for v in p.read_q_by_node().values())
    for i in range(p.num_prefill):
        rep = p.prefill_report(i)
        assert (rep.num_seqs, rep.num_tokens) == (0, 0)
    for j in range(p.num_decode):
        rep = p.decode_report(j)
        assert (rep.num_seqs, rep.num_tokens) == (0, 0)


def test_modes_map_to_the_paper_switches() -> None:
    basic, rr = route_params("basic", BS, KV)
    assert basic.path_mode is PathMode.PE and rr
    dual, rr = route_params("dualpath", BS, KV)
    assert dual.path_mode is PathMode.DUAL and not rr
    split, rr = route_params("split", BS, KV)
    assert split.path_mode is PathMode.SPLIT and not rr
    # alpha: 3 s of the storage NIC (100 Gb/s = 12.5e9 B/s) over 10 B/token.
    assert dual.alpha_tokens == pytest.approx(12.5e9 * 3 / KV)
    assert dual.block_size_tokens == BS and dual.kv_bytes_per_token == KV
    with pytest.raises(SpecError, match="mode"):
        route_params("oracle", BS, KV)


def test_basic_always_reads_on_the_pe_side() -> None:
    p = policy("basic")
    for rid in range(1, 5):
        place(p, rid)
    routes = p.schedule()
    assert [r.request_id for r in routes] == [1, 2, 3, 4]
    assert all(r.plan.num_pe_blocks == r.plan.num_hit_blocks == 4 for r in routes)
    assert {r.path for r in routes} == {"pe"}
    assert p.read_q_by_node() == {0: 4 * 4 * BS, 1: 0}


def test_basic_round_robins_over_prefill_and_decode_instances() -> None:
    p = policy("basic", num_prefill=2, num_decode=2)
    for rid in range(1, 5):
        place(p, rid)
    routes = p.schedule()
    # Decode groups in turn by arrival; the PE queue holds them in DE-fetch order (group 0's
    # first), and the prefill instances take that queue in turn.
    assert {r.request_id: r.decode for r in routes} == {1: 0, 2: 1, 3: 0, 4: 1}
    assert [r.request_id for r in routes] == [1, 3, 2, 4]
    assert [r.prefill for r in routes] == [0, 1, 0, 1]


def test_dualpath_reads_on_the_de_side_when_the_pe_queue_is_longer() -> None:
    p = policy("dualpath")
    place(p, 1)
    (first,) = p.schedule()
    assert first.path == "pe"  # equal (empty) queues: the PE side
    assert p.read_q_by_node() == {0: 4 * BS, 1: 0}
    place(p, 2)
    (second,) = p.schedule()
    assert second.path == "de" and second.plan.num_pe_blocks == 0
    assert second.plan.num_de_blocks == 4
    assert p.read_q_by_node() == {0: 4 * BS, 1: 4 * BS}
    # Once the first prefill replies its PE-side read is done: the PE queue is shorter again.
    p.prefill_done(1)
    place(p, 3)
    (third,) = p.schedule()
    assert third.path == "pe"
    assert p.counters.requests_by_path == {"pe": 2, "de": 1}
    assert p.counters.blocks_by_side == {"pe": 8, "de": 4}


def test_dualpath_balances_prefill_instances_by_tokens() -> None:
    p = policy("dualpath", num_prefill=2)
    place(p, 1, prompt=400, hit=0)
    place(p, 2, prompt=40, hit=0)
    place(p, 3, prompt=40, hit=0)
    routes = p.schedule()
    assert [r.prefill for r in routes] == [0, 1, 1]
    assert all(r.path == "none" for r in routes)


def test_split_splits_one_read_across_both_sides() -> None:
    p = policy("split")
    place(p, 1, hit=2)
    (first,) = p.schedule()
    assert first.plan.num_pe_blocks == 1 and first.plan.num_de_blocks == 1
    assert first.path == "split"
    place(p, 2, hit=4)
    (second,) = p.schedule()
    # Both queues hold one block: four more drain together at two a side.
    assert second.plan.num_pe_blocks == 2 and second.plan.num_de_blocks == 2
    assert p.read_q_by_node() == {0: 3 * BS, 1: 3 * BS}


def test_overloaded_prefill_waits_and_is_released_by_a_reply() -> None:
    p = policy("dualpath", beta=30)
    place(p, 1, prompt=40)
    place(p, 2, prompt=40)
    routes = p.schedule()
    assert [r.request_id for r in routes] == [1]  # tok 0 <= 30 took it; then 40 > 30
    assert p.num_waiting == 1 and p.schedule() == []
    p.prefill_done(1)  # the prefill instance's load falls back to 0
    (second,) = p.schedule()
    assert second.request_id == 2
    p.finished(1)
    p.prefill_done(2)
    p.finished(2)
    assert_idle(p)


def test_decode_admission_waits_for_kv_memory() -> None:
    # Capacity 500 B: a 40-token prompt with 5 generated tokens needs 450 B.
    p = policy("dualpath", capacity=500)
    place(p, 1, gen=5)
    place(p, 2, gen=5)
    assert [r.request_id for r in p.schedule()] == [1]
    assert p.decode_report(0).free_hbm_bytes == 50
    # The decode instance reports its usage: the request there is counted by vLLM now.
    p.prefill_done(1)
    p.update_metrics(Role.DECODE, 0, InstanceMetrics(kv_usage=0.5))
    assert p.decode_report(0).free_hbm_bytes == 250
    assert p.schedule() == []
    p.finished(1)
    p.update_metrics(Role.DECODE, 0, InstanceMetrics(kv_usage=0.0))
    assert [r.request_id for r in p.schedule()] == [2]


def test_accounting_returns_to_zero_after_aborts_anywhere() -> None:
    p = policy("dualpath", beta=30)
    place(p, 1)
    place(p, 2)  # bound to the decode instance, waiting for the prefill instance
    place(p, 3)
    assert len(p.schedule()) == 1
    assert p.decode_report(0).num_seqs == 3
    assert p.abort(2) is True  # still waiting: dropped from the scheduler's queue
    assert p.abort(1) is False  # placed: its seats are freed
    assert p.decode_report(0).num_seqs == 1
    (third,) = p.schedule()
    assert third.request_id == 3
    p.prefill_done(3)
    assert p.abort(3) is False
    assert p.abort(3) is False  # twice is harmless
    assert_idle(p)
    assert p.counters.num_aborted == 3


def test_submitting_an_id_twice_is_refused() -> None:
    p = policy("dualpath")
    place(p, 1)
    with pytest.raises(SpecError, match="twice"):
        place(p, 1)


def test_forced_read_side_overrides_the_plan_and_its_read_queues() -> None:
    params, rr = route_params("dualpath", BS, KV, alpha_tokens=1e9)
    p = RoutePolicy(params, 1, 1, rr, forced_read_side="de")
    place(p, 1)
    (route,) = p.schedule()
    assert route.path == "de" and route.plan.num_de_blocks == 4
    assert p.read_q_by_node() == {0: 0, 1: 4 * BS}
    with pytest.raises(SpecError, match="force_read_side"):
        RoutePolicy(params, 1, 1, rr, forced_read_side="both")


# -- instances marked down (failover) ---------------------------------------------------------
@pytest.mark.parametrize("mode", ["basic", "dualpath", "split"])
def test_a_down_decode_instance_gets_no_request_and_rejoins(mode: str) -> None:
    p = policy(mode, num_prefill=1, num_decode=3)
    p.mark_down(Role.DECODE, 1)
    for rid in range(1, 7):
        place(p, rid)
    routes = p.schedule()
    assert len(routes) == 6 and {r.decode for r in routes} == {0, 2}
    assert p.decode_report(1).num_seqs == 0
    p.mark_up(Role.DECODE, 1)
    for rid in range(7, 13):
        place(p, rid)
    assert 1 in {r.decode for r in p.schedule()}


@pytest.mark.parametrize("mode", ["basic", "dualpath"])
def test_a_down_prefill_instance_gets_no_request_and_rejoins(mode: str) -> None:
    p = policy(mode, num_prefill=2)
    p.mark_down(Role.PREFILL, 0)
    for rid in range(1, 5):
        place(p, rid)
    assert {r.prefill for r in p.schedule()} == {1}
    snap = p.snapshot(64)
    assert [i["up"] for i in snap["prefill"]] == [False, True]
    assert snap["prefill"][0]["in_flight_tokens"] == 0  # down is no load of its own
    p.mark_up(Role.PREFILL, 0)
    for rid in range(5, 9):
        place(p, rid)
    assert 0 in {r.prefill for r in p.schedule()}


def test_requests_waiting_on_a_decode_that_goes_down_are_bound_again() -> None:
    p = policy("dualpath", num_prefill=1, num_decode=2, beta=30)
    place(p, 1)  # placed: the prefill instance is then full (40 tokens > beta 30)
    place(p, 2)  # bound to a decode instance, waiting for the prefill instance
    (first,) = p.schedule()
    waiting_on = 1 - first.decode
    assert p.decode_report(waiting_on).num_seqs == 1
    p.mark_down(Role.DECODE, waiting_on)
    assert p.schedule() == []
    assert p.decode_report(waiting_on).num_seqs == 0
    assert p.decode_report(first.decode).num_seqs == 2
    p.prefill_done(1)
    (second,) = p.schedule()
    assert second.request_id == 2 and second.decode == first.decode


def test_with_every_decode_down_requests_wait_until_one_is_up() -> None:
    p = policy("basic", num_decode=2)
    p.mark_down(Role.DECODE, 0)
    p.mark_down(Role.DECODE, 1)
    place(p, 1)
    assert p.schedule() == [] and p.num_waiting == 1
    p.mark_up(Role.DECODE, 1)
    (route,) = p.schedule()
    assert route.decode == 1


def test_a_requeued_request_gets_a_new_route_and_its_seats_back() -> None:
    p = policy("dualpath", num_prefill=2, num_decode=2)
    place(p, 1)
    (route,) = p.schedule()
    p.mark_down(Role.DECODE, route.decode)
    p.mark_down(Role.PREFILL, route.prefill)
    p.requeue(1)
    assert p.read_q_by_node() == dict.fromkeys(range(4), 0)
    (again,) = p.schedule()
    assert (again.prefill, again.decode) == (1 - route.prefill, 1 - route.decode)
    assert p.decode_report(route.decode).num_seqs == 0
    p.prefill_done(1)
    p.finished(1)
    p.mark_up(Role.PREFILL, route.prefill)
    assert_idle(p)
    assert p.counters.num_requeued == 1
    with pytest.raises(SpecError, match="unknown"):
        p.requeue(1)


def recounted(p: RoutePolicy) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]],
                                       dict[int, int]]:
    """Every report's loads counted from the requests one by one (the pre-incremental rule)."""
    reqs = list(p._requests.values())
    prefill = [(len(mine), sum(p.sched.pe_charge(q.request) for q in mine)) for i in
               range(p.num_prefill) for mine in [[q for q in reqs if q.route is not None and
                                                  not q.is_prefilled and q.route.prefill == i]]]
    decode = []
    for j in range(p.num_decode):
        bound = [q for q in reqs if q.de is not None and q.de[0] == j]
        sample = p.metrics.get(("decode", j), InstanceMetrics())
        assert sample.kv_usage is not None and sample.kv_capacity_bytes is not None
        unsent = sum(q.de[1] for q in bound if q.de is not None and not q.is_prefilled)
        decode.append((len(bound), sum(p.sched.de_charge(q.request) for q in bound),
                       max(0, int(sample.kv_capacity_bytes * (1 - sample.kv_usage)) - unsent)))
    read_q = dict.fromkeys(range(p.num_prefill + p.num_decode), 0)
    for q in reqs:
        if q.route is not None and not q.is_prefilled:
            read_q[q.route.prefill] += q.route.plan.pe_read_tokens
            read_q[p.num_prefill + q.route.decode] += q.route.plan.de_read_tokens
    return prefill, decode, read_q


@pytest.mark.parametrize("mode", ["basic", "dualpath", "split"])
def test_loads_kept_as_requests_change_equal_a_recount(mode: str) -> None:
    # Loads are sums updated on every change of a request; a random run of every change
    # (placements, replies, ends, aborts, requeues, instances down and up) must leave them
    # equal to counting the requests one by one, at every step.
    rng = random.Random(7)
    p = policy(mode, num_prefill=3, num_decode=3, beta=400)
    for j in range(3):
        p.update_metrics(Role.DECODE, j, InstanceMetrics(kv_usage=0.1,
                                                         kv_capacity_bytes=20_000))
    live: list[int] = []
    for rid in range(400):
        op = rng.random()
        if op < 0.4:
            p.submit(rid, rng.randrange(8, 80), rng.randrange(0, 3), 4)
            live.append(rid)
        elif live and op < 0.6:
            p.prefill_done(rng.choice(live))
        elif op < 0.7:
            placed = [rid for rid in live if p._requests[rid].route is not None]
            if placed:  # only a placed request's decode reply ends
                done = rng.choice(placed)
                live.remove(done)
                p.prefill_done(done)
                p.finished(done)
        elif live and op < 0.8:
            p.abort(live.pop(rng.randrange(len(live))))
        elif live and op < 0.85:
            p.requeue(rng.choice(live))
        elif op < 0.9:
            p.mark_down(rng.choice(list(Role)), rng.randrange(3))
        else:
            p.mark_up(rng.choice(list(Role)), rng.randrange(3))
        p.schedule()
        prefill, decode, read_q = recounted(p)
        assert [(r.num_seqs, r.num_tokens) for r in map(p.prefill_report, range(3))
                if p.is_up(Role.PREFILL, r.engine_id)] == \
            [c for i, c in enumerate(prefill) if p.is_up(Role.PREFILL, i)]
        assert [(r.num_seqs, r.num_tokens, r.free_hbm_bytes)
                for r in map(p.decode_report, range(3))] == decode
        assert p.read_q_by_node() == read_q
    for rid in live:
        p.abort(rid)
    for role in Role:
        for i in range(3):
            p.mark_up(role, i)
    assert_idle(p)
