"""Inter-engine DE scheduling, two levels (paper §6.1), and the round-robin baselines.

Phase 1 (`de_global_drain`): when any DE group fetches, the whole global queue is drained, each
request going to the group with the minimum load, whose load then grows by the request's
`len`. Does not preserve global FIFO across groups; does preserve it within each group.

Phase 2 (`de_group_fetch`), within the fetching group with engines E:
- R: the FIFO prefix of the private queue that fits the group's total free HBM assuming no
  fragmentation (`SchedulerParams.r_set_stops_at_first_misfit`: stop at, or skip, a misfit);
- `Z = z_factor * (sum of len over R + sum of tok over E) / |E|`;
- then the head request r goes, among DEs with free HBM >= need(r), to the minimum-`seq` DE
  with `tok + len(r) <= Z`, else to the minimum-`tok` DE (ties: lower engine id); that DE's
  seq, tok and free HBM are updated; the fetch ends when no DE has enough HBM for the head.
- `SchedulerParams.max_seqs_per_decode_engine` > 0 (not in the paper) also rules out a DE that
  holds that many sequences, and R then also stops at the group's free slots (what one fetch
  can place at most), so Z counts only requests this fetch could admit.

`len(r)` is `SchedulerParams.de_tok_charge` of r, the same amount it adds to `tok`.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Mapping, Sequence

from dualpath.core.errors import SpecError
from dualpath.sched.params import SchedulerParams
from dualpath.sched.path import ReadSideChooser, plan_pair_read
from dualpath.sched.snapshot import check_reports, read_queues_by_node
from dualpath.sched.types import (
    DEAssignment,
    DEFetch,
    EngineReport,
    GroupAssignment,
    ReadPlan,
    Role,
    WaitingRequest,
)


def de_global_drain(
    queue: Iterable[WaitingRequest],
    group_load_tokens: Mapping[int, int],
    params: SchedulerParams,
) -> tuple[GroupAssignment, ...]:
    """Phase 1: every request of `queue` to the group of minimum load (ties: lower group id).

    `group_load_tokens` maps each DE group to its load: the sum of its engines' `tok`, plus
    (recommended) the `len` of requests already waiting in its private queue, which are
    committed to it but not yet in any `tok`. O(n log groups).
    """
    if not group_load_tokens:
        raise SpecError("de_drain", "group_load_tokens", {}, "needs at least one DE group")
    if isinstance(queue, Sequence) and len(queue) == 1:
        # One request (the common case: a single arrival): the heap's top is the minimum
        # (load, gid) pair; found in C without building the heap.
        _, gid = min(zip(group_load_tokens.values(), group_load_tokens.keys(), strict=True))
        return (GroupAssignment(queue[0].request_id, gid),)
    heap = list(zip(group_load_tokens.values(), group_load_tokens.keys(), strict=True))
    heapq.heapify(heap)
    out: list[GroupAssignment] = []
    for r in queue:
        load, gid = heap[0]
        heapq.heapreplace(heap, (load + params.de_tok_charge.tokens(r), gid))
        out.append(GroupAssignment(r.request_id, gid))
    return tuple(out)


def de_least_loaded_group(group_load_tokens: Sequence[int]) -> int:
    """Phase 1 for a single request: the index of the minimum load, ties to the lower index.
    The same choice as `de_global_drain` over `dict(enumerate(group_load_tokens))` for a queue
    of one request, without building the mapping (a caller that holds loads by group index
    runs it on every arrival, over every DE group)."""
    if not group_load_tokens:
        raise SpecError("de_drain", "group_load_tokens", [], "needs at least one DE group")
    best = 0
    best_load = group_load_tokens[0]
    for g in range(1, len(group_load_tokens)):
        load = group_load_tokens[g]
        if load < best_load:
            best, best_load = g, load
    return best


def de_global_drain_round_robin(
    queue: Iterable[WaitingRequest], group_ids: Sequence[int], start: int = 0
) -> tuple[tuple[GroupAssignment, ...], int]:
    """Baseline phase 1: groups in turn from position `start`; returns the next start."""
    if not group_ids:
        raise SpecError("de_drain", "group_ids", group_ids, "needs at least one DE group")
    pos = start % len(group_ids)
    out: list[GroupAssignment] = []
    for r in queue:
        out.append(GroupAssignment(r.request_id, group_ids[pos]))
        pos = (pos + 1) % len(group_ids)
    return tuple(out), pos


def r_set(
    queue: Iterable[WaitingRequest], total_free_hbm_bytes: int, params: SchedulerParams,
    free_slots: int | None = None,
) -> tuple[list[WaitingRequest], int, int]:
    """(the FIFO-prefix candidates for placement, |R|, sum of len over R).

    The prefix is what the placement loop may reach: it stops at the first request that does
    not fit the remaining total, since placing per engine can never fit more than the total.
    With a sequence cap, `free_slots` (the group's sequences still below the cap) also bounds
    R: no more requests than that can be placed in this fetch.
    """
    free = total_free_hbm_bytes
    prefix: list[WaitingRequest] = []
    num_r, len_r = 0, 0
    in_prefix = True
    for r in queue:
        if free_slots is not None and num_r >= free_slots:
            break
        need = params.hbm_bytes(r)
        if need <= free:
            free -= need
            num_r += 1
            len_r += params.de_tok_charge.tokens(r)
            if in_prefix:
                prefix.append(r)
        elif params.r_set_stops_at_first_misfit:
            break
        else:
            in_prefix = False
    return prefix, num_r, len_r


def de_group_fetch(
    private_queue: Iterable[WaitingRequest],
    reports: Sequence[EngineReport],
    params: SchedulerParams,
    *,
    pe_node_of: Mapping[int, int] | None = None,
    read_q_tokens_by_node: Mapping[int, int] | None = None,
    is_validated: bool = False,
    sides: ReadSideChooser | None = None,
) -> DEFetch:
    """Phase 2 for one DE group fetch over its private FIFO queue (head first).

    `pe_node_of` maps a request id to its PE's node when the PE is already bound (PE-first
    order); for those requests the read path is chosen here and added to the read queues.

    Invariants kept: no engine is given more HBM than it reported free (nor the group more
    than its total); a DE with `tok + len > Z` is chosen only when no DE with enough HBM is
    under Z; assignments are a FIFO prefix of `private_queue`; inputs are not changed.
    Cost: O(|E| log |E| + |R|) for R and Z, then per assignment a scan of the engines still
    under Z in `seq` order that stops at the first one with room under Z and enough HBM
    (O(|E|) only when none has).

    `is_validated=True` skips `check_reports` (as in `pe.pe_fetch`: a trusted caller only).
    """
    if not is_validated:
        check_reports(reports, Role.DECODE)
    n = len(reports)
    engine_ids = [r.engine_id for r in reports]
    seq = [r.num_seqs for r in reports]
    tok = [r.num_tokens for r in reports]
    free = [r.free_hbm_bytes for r in reports]
    read_q = read_queues_by_node(reports, read_q_tokens_by_node)
    decide_q = read_q if params.update_read_q_within_fetch else dict(read_q)
    candidates, num_r, len_r = r_set(private_queue, sum(max(0, f) for f in free), params,
                                     params.free_de_slots(seq))
    z = params.z_factor * (len_r + sum(tok)) / n
    # tok only grows within a fetch and Z is fixed, so an engine above Z never becomes a
    # class-2 candidate again: keep candidates sorted by (seq, id) and the rest by (tok, id).
    low = sorted((seq[i], engine_ids[i], i) for i in range(n) if tok[i] <= z)
    high = sorted((tok[i], engine_ids[i], i) for i in range(n) if tok[i] > z)
    assignments: list[DEAssignment] = []
    for r in candidates:
        need = params.hbm_bytes(r)
        length = params.de_tok_charge.tokens(r)
        chosen, fallback = -1, -1
        for _, _, i in low:
            if free[i] < need or params.is_de_full(seq[i]):
                continue
            if tok[i] + length <= z:
                chosen = i
                break
            if fallback < 0 or (tok[i], engine_ids[i]) < (tok[fallback], engine_ids[fallback]):
                fallback = i
        if chosen < 0:
            for t, e, i in high:
                if free[i] >= need and not params.is_de_full(seq[i]):
                    if fallback < 0 or (t, e) < (tok[fallback], engine_ids[fallback]):
                        fallback = i
                    break
            chosen = fallback
            if chosen < 0:
                break  # no DE has enough HBM for the head: the fetch ends
        if tok[chosen] <= z:
            del low[bisect.bisect_left(low, (seq[chosen], engine_ids[chosen], chosen))]
        else:
            del high[bisect.bisect_left(high, (tok[chosen], engine_ids[chosen], chosen))]
        seq[chosen] += 1
        tok[chosen] += length
        free[chosen] -= need
        if tok[chosen] <= z:
            bisect.insort(low, (seq[chosen], engine_ids[chosen], chosen))
        else:
            bisect.insort(high, (tok[chosen], engine_ids[chosen], chosen))
        rep = reports[chosen]
        plan = _plan_de(params, r, rep.node_id, pe_node_of, decide_q, read_q, sides)
        assignments.append(DEAssignment(r.request_id, rep.engine_id, rep.node_id, need, plan))
    return DEFetch(tuple(assignments), z, num_r, read_q)


def _plan_de(
    params: SchedulerParams,
    r: WaitingRequest,
    de_node: int,
    pe_node_of: Mapping[int, int] | None,
    decide_q: dict[int, int],
    read_q: dict[int, int],
    sides: ReadSideChooser | None,
) -> ReadPlan | None:
    if pe_node_of is None or r.request_id not in pe_node_of:
        return None
    pe_node = pe_node_of[r.request_id]
    return plan_pair_read(params, r.hit_tokens, pe_node, de_node, decide_q, read_q, sides)


def de_group_fetch_round_robin(
    private_queue: Iterable[WaitingRequest],
    reports: Sequence[EngineReport],
    params: SchedulerParams,
    start: int = 0,
    *,
    pe_node_of: Mapping[int, int] | None = None,
    read_q_tokens_by_node: Mapping[int, int] | None = None,
    is_validated: bool = False,
    sides: ReadSideChooser | None = None,
) -> tuple[DEFetch, int]:
    """Baseline phase 2: the head goes to the next engine in report order from `start` that
    has enough HBM (ignoring seq, tok and Z); the fetch ends when none has. Returns the fetch
    and the next start. Same HBM admission (and sequence cap) as `de_group_fetch`."""
    if not is_validated:
        check_reports(reports, Role.DECODE)
    n = len(reports)
    free = [r.free_hbm_bytes for r in reports]
    seq = [r.num_seqs for r in reports]
    read_q = read_queues_by_node(reports, read_q_tokens_by_node)
    decide_q = read_q if params.update_read_q_within_fetch else dict(read_q)
    pos = start % n
    assignments: list[DEAssignment] = []
    for r in private_queue:
        need = params.hbm_bytes(r)
        for k in range(n):
            j = (pos + k) % n
            if free[j] >= need and not params.is_de_full(seq[j]):
                i = j
                break
        else:
            break
        free[i] -= need
        seq[i] += 1
        pos = (i + 1) % n
        rep = reports[i]
        plan = _plan_de(params, r, rep.node_id, pe_node_of, decide_q, read_q, sides)
        assignments.append(DEAssignment(r.request_id, rep.engine_id, rep.node_id, need, plan))
    return DEFetch(tuple(assignments), 0.0, 0, read_q), pos
