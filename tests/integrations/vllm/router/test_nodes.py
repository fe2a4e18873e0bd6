"""The router's policy over engines grouped by node (data-parallel ranks as engines), and its
pruned prefill fetches, which must decide exactly as fetches over every engine."""

from __future__ import annotations

import random

import pytest

from dualpath.core.errors import SpecError
from dualpath.integrations.vllm.router.loads import Layout, PrefillIndex
from dualpath.integrations.vllm.router.policy import RoutePolicy, route_params
from dualpath.sched.pe import pe_fetch
from dualpath.sched.types import EngineReport, Role, WaitingRequest

BS = 4
KV = 10.0


def test_a_layout_numbers_prefill_nodes_then_decode_nodes() -> None:
    layout = Layout.of_names(["a", "a", "b"], ["c", "c", "c", "c"])
    assert layout.prefill_node == (0, 0, 1) and layout.decode_node == (2, 2, 2, 2)
    assert layout.decodes_of_group() == [[0, 1, 2, 3]]
    assert Layout.one_per_node(2, 1) == Layout((0, 1), (2,))
    with pytest.raises(SpecError, match="one role"):
        Layout.of_names(["a"], ["a"])


def test_ranks_of_a_decode_node_are_one_group_and_share_its_read_queue() -> None:
    # Two decode nodes of two DP ranks each: phase 1 picks the node (DE group), phase 2 the
    # rank; reads on a node add to one queue, whichever rank is bound.
    layout = Layout.of_names(["p0", "p1"], ["d0", "d0", "d1", "d1"])
    params, rr = route_params("dualpath", BS, KV, alpha_tokens=1e9, beta_tokens=1e9)
    p = RoutePolicy(params, 2, 4, rr, None, layout=layout)
    for rid in range(1, 9):
        p.submit(rid, 40, 4, 0)
        p.schedule()
    snap = p.snapshot(64)
    assert [d["in_flight"] for d in snap["decode"]] == [2, 2, 2, 2]
    assert [d["node"] for d in snap["decode"]] == [2, 2, 3, 3]
    assert [i["in_flight"] for i in snap["prefill"]] == [4, 4]
    read_q = p.read_q_by_node()
    assert sum(read_q.values()) == 8 * 4 * BS
    assert snap["decode"][0]["read_queue_tokens"] == snap["decode"][1]["read_queue_tokens"] \
        == read_q[2]
    # A rank down: its node's other rank takes the node's requests; the node goes down
    # only with both.
    p.mark_down(Role.DECODE, 0)
    p.submit(9, 40, 0, 0)
    p.submit(10, 40, 0, 0)
    routes = p.schedule()
    assert 0 not in {r.decode for r in routes}
    p.mark_down(Role.DECODE, 1)
    p.submit(11, 40, 0, 0)
    (route,) = p.schedule()
    assert route.decode in (2, 3)


@pytest.mark.parametrize(("per_node", "seed"), [(1, 0), (3, 1), (4, 2)])
def test_pruned_prefill_fetches_decide_as_fetches_over_every_engine(per_node: int,
                                                                    seed: int) -> None:
    rng = random.Random(seed)
    num_prefill, num_decode = 64, 8
    layout = Layout.of_names([f"p{i // per_node}" for i in range(num_prefill)],
                             [f"d{j // 2}" for j in range(num_decode)])
    # A small alpha and beta: nodes move between the short and long read queue categories
    # and engines become overloaded within the run.
    params, rr = route_params("dualpath", BS, KV, alpha_tokens=40, beta_tokens=600)
    pruned, full = (RoutePolicy(params, num_prefill, num_decode, rr, None, layout=layout,
                                is_pruned=is_pruned) for is_pruned in (True, False))
    next_id = 1
    placed: list[int] = []
    prefilled: list[int] = []
    num_bursts = 0
    for _ in range(800):
        op = rng.random()
        if op < 0.45:
            burst = rng.choice([1, 1, 2, 3, 4])  # several arrivals in one decision
            num_bursts += burst > 1
            for _ in range(burst):
                prompt = rng.randrange(8, 200)
                for p in (pruned, full):
                    p.submit(next_id, prompt, random.Random(next_id).randrange(0, prompt // BS),
                             0)
                next_id += 1
        elif op < 0.7 and placed:
            rid = placed.pop(rng.randrange(len(placed)))
            for p in (pruned, full):
                p.prefill_done(rid)
            prefilled.append(rid)
        elif op < 0.85 and prefilled:
            rid = prefilled.pop(rng.randrange(len(prefilled)))
            for p in (pruned, full):
                p.finished(rid)
        elif op < 0.95:
            i = rng.randrange(num_prefill)
            is_down = rng.random() < 0.5
            for p in (pruned, full):
                (p.mark_down if is_down else p.mark_up)(Role.PREFILL, i)
        elif next_id > 1:
            rid = rng.randrange(1, next_id)
            for p in (pruned, full):
                p.abort(rid)
            placed = [x for x in placed if x != rid]
            prefilled = [x for x in prefilled if x != rid]
        routes = pruned.schedule()
        assert routes == full.schedule()
        placed += [r.request_id for r in routes]
    assert num_bursts > 10 and len(placed) + len(prefilled) > 0
    assert pruned.counters == full.counters


@pytest.mark.parametrize("per_node", [1, 2, 4])
def test_the_prefill_index_holds_every_engine_algorithm_1_would_choose(per_node: int) -> None:
    # Random engine states and queues: Algorithm 1 over the index's candidates assigns as
    # over every engine (reads move nodes to the long category within the fetch).
    rng = random.Random(per_node)
    params, _ = route_params("dualpath", BS, KV, alpha_tokens=100, beta_tokens=1000)
    num_engines, num_de_nodes = 32, 4
    node_of = [i // per_node for i in range(num_engines)]
    num_nodes = node_of[-1] + 1
    num_pruned = 0
    for trial in range(400):
        tok = [rng.randrange(0, 1200) for _ in range(num_engines)]
        read_q = {n: rng.choice([0, 40, 90, 150]) for n in range(num_nodes + num_de_nodes)}
        down = {i for i in range(num_engines) if rng.random() < 0.1}

        def state(i: int, tok: list[int] = tok, read_q: dict[int, int] = read_q,
                  down: set[int] = down) -> tuple[int, bool, bool]:
            return (tok[i], read_q[node_of[i]] <= params.alpha_tokens,
                    tok[i] <= params.beta_tokens and i not in down)

        index = PrefillIndex(node_of, state)
        for i in range(num_engines):
            index.touch(i)
        queue = [WaitingRequest(r, 200, BS * rng.randrange(0, 30), 0)
                 for r in range(rng.choice([1, 1, 2, 3]))]
        de_node_of = {r.request_id: num_nodes + rng.randrange(num_de_nodes) for r in queue}

        def reports(engines: list[int], tok: list[int] = tok, read_q: dict[int, int] = read_q,
                    down: set[int] = down) -> list[EngineReport]:
            return [EngineReport(i, node_of[i], Role.PREFILL, 0,
                                 max(tok[i], 1001) if i in down else tok[i],
                                 read_q[node_of[i]], 2**62) for i in engines]

        engines = index.candidates(len(queue))
        if engines is None:
            continue
        num_pruned += 1
        got, want = (pe_fetch(queue, reports(e), params, de_node_of=de_node_of,
                              read_q_tokens_by_node=read_q).assignments
                     for e in (engines, list(range(num_engines))))
        assert got == want, f"trial {trial}"
    assert num_pruned > 300
