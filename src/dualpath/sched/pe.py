"""Inter-engine PE scheduling: the paper's Algorithm 1 (§6.1), and its round-robin baseline.

Engine categories at each step of a fetch, from the group's reports:
  1. overloaded:        `tok > beta`                      (never receives work)
  2. short read queue:  `read_q <= alpha` and `tok <= beta`
  3. long read queue:   `read_q > alpha`  and `tok <= beta`
The FIFO head goes to the minimum-`tok` engine of category 2, else of category 3 (ties: lower
engine id); that engine's `tok` grows by the request's charge and the next request follows.
The fetch ends when categories 2 and 3 are both empty, or the queue is.

Cost: two lazy-deletion heaps keyed by `(tok, engine_id)`, so one fetch is
O(num_engines + assigned * log num_engines), independent of the queue length.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence

from dualpath.sched.params import SchedulerParams
from dualpath.sched.path import ReadSideChooser, plan_pair_read
from dualpath.sched.snapshot import check_reports, read_queues_by_node
from dualpath.sched.types import EngineReport, PEAssignment, PEFetch, ReadPlan, Role, WaitingRequest


def _plan(
    params: SchedulerParams,
    r: WaitingRequest,
    pe_node: int,
    de_node_of: Mapping[int, int] | None,
    decide_q: dict[int, int],
    read_q: dict[int, int],
    sides: ReadSideChooser | None,
) -> ReadPlan | None:
    """The read plan of `r` if its DE is known, added to `read_q`. Decisions look at
    `decide_q`, which is `read_q` itself when reads update the queues within a fetch and the
    fetch-start snapshot otherwise; `sides` is the scheduler's read-side state (`path`)."""
    if de_node_of is None or r.request_id not in de_node_of:
        return None
    de_node = de_node_of[r.request_id]
    return plan_pair_read(params, r.hit_tokens, pe_node, de_node, decide_q, read_q, sides)


def pe_fetch(
    queue: Iterable[WaitingRequest],
    reports: Sequence[EngineReport],
    params: SchedulerParams,
    *,
    de_node_of: Mapping[int, int] | None = None,
    read_q_tokens_by_node: Mapping[int, int] | None = None,
    is_validated: bool = False,
    sides: ReadSideChooser | None = None,
) -> PEFetch:
    """Algorithm 1 for one PE group fetch over the global FIFO `queue` (head first).

    `de_node_of` maps a request id to its DE's node when the DE is already bound (DE-first
    order); for those requests the read path is chosen here (`params.path_mode`) and, if
    `params.update_read_q_within_fetch`, the read is added to the chosen nodes' queues at
    once, which can move the PE node's engines from category 2 to 3. `read_q_tokens_by_node`
    is the caller's view of nodes outside the group (the DE nodes).

    Invariants kept: an engine with `tok > beta` never receives a request; category 2 is
    always preferred to category 3; assignments are a FIFO prefix of `queue`; inputs are not
    changed.

    `is_validated=True` skips `check_reports`: only for a caller that builds its reports from
    its own consistent state (the simulator); the decision is the same on valid reports.
    `sides`: the scheduler's read-side state (`path.ReadSideChooser`; None: the queue rule with
    a fixed tie side).
    """
    if not is_validated:
        check_reports(reports, Role.PREFILL)
    alpha, beta = params.alpha_tokens, params.beta_tokens
    charge = params.pe_tok_charge
    engine_ids = [r.engine_id for r in reports]
    node_ids = [r.node_id for r in reports]
    tok = [r.num_tokens for r in reports]
    read_q = read_queues_by_node(reports, read_q_tokens_by_node)
    decide_q = read_q if params.update_read_q_within_fetch else dict(read_q)
    engines_of_node: dict[int, list[int]] = {}
    for i, n in enumerate(node_ids):
        engines_of_node.setdefault(n, []).append(i)
    # short[n]: node n's engines are category 2 (else 3). read_q only grows within a fetch,
    # so a node moves 2 -> 3 at most once and never back.
    short = {n: read_q[n] <= alpha for n in engines_of_node}
    h2: list[tuple[int, int, int]] = []
    h3: list[tuple[int, int, int]] = []
    for i in range(len(reports)):
        if tok[i] <= beta:
            (h2 if short[node_ids[i]] else h3).append((tok[i], engine_ids[i], i))
    heapq.heapify(h2)
    heapq.heapify(h3)

    def top(h: list[tuple[int, int, int]], want_short: bool) -> int:
        # Lazy deletion: an entry is live iff its tok is current and its node's category
        # still matches the heap (stale entries have an older, smaller tok or moved node).
        while h:
            t, _, i = h[0]
            if t == tok[i] and short[node_ids[i]] is want_short:
                return i
            heapq.heappop(h)
        return -1

    assignments: list[PEAssignment] = []
    for r in queue:
        i = top(h2, True)
        h = h2
        if i < 0:
            i = top(h3, False)
            h = h3
            if i < 0:
                break  # every engine is overloaded: the fetch ends
        heapq.heappop(h)
        node = node_ids[i]
        tok[i] += charge.tokens(r)
        plan = _plan(params, r, node, de_node_of, decide_q, read_q, sides)
        if tok[i] <= beta:
            heapq.heappush(h, (tok[i], engine_ids[i], i))
        if short[node] and decide_q[node] > alpha:
            short[node] = False
            for j in engines_of_node[node]:
                if tok[j] <= beta:
                    heapq.heappush(h3, (tok[j], engine_ids[j], j))
        assignments.append(PEAssignment(r.request_id, engine_ids[i], node, plan))
    return PEFetch(tuple(assignments), read_q)


def pe_fetch_round_robin(
    queue: Iterable[WaitingRequest],
    reports: Sequence[EngineReport],
    params: SchedulerParams,
    start: int = 0,
    *,
    de_node_of: Mapping[int, int] | None = None,
    read_q_tokens_by_node: Mapping[int, int] | None = None,
    is_validated: bool = False,
    sides: ReadSideChooser | None = None,
) -> tuple[PEFetch, int]:
    """The "w/o scheduling" baseline: the FIFO head goes to the next engine in report order
    from position `start`, ignoring `tok` and `read_q`; returns the fetch and the next start.

    Admission is the same as Algorithm 1's (an engine with `tok > beta` is skipped; the fetch
    ends when all are), so the ablation isolates the choice rule. Read paths as in `pe_fetch`.
    """
    if not is_validated:
        check_reports(reports, Role.PREFILL)
    n = len(reports)
    tok = [r.num_tokens for r in reports]
    read_q = read_queues_by_node(reports, read_q_tokens_by_node)
    decide_q = read_q if params.update_read_q_within_fetch else dict(read_q)
    pos = start % n
    assignments: list[PEAssignment] = []
    for r in queue:
        for k in range(n):
            if tok[(pos + k) % n] <= params.beta_tokens:
                i = (pos + k) % n
                break
        else:
            break
        tok[i] += params.pe_tok_charge.tokens(r)
        pos = (i + 1) % n
        rep = reports[i]
        plan = _plan(params, r, rep.node_id, de_node_of, decide_q, read_q, sides)
        assignments.append(PEAssignment(r.request_id, rep.engine_id, rep.node_id, plan))
    return PEFetch(tuple(assignments), read_q), pos
