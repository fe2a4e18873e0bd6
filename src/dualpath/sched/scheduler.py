"""The one stateful inter-engine scheduler both worlds drive: queues, charges and cursors around
the pure policies of `pe`, `de` and `path`.

No clocks, threads or I/O: time never enters, and every load comes in as an argument (the
engines' `EngineReport`s of the fetching group, the group loads of DE phase 1, other nodes' read
queues). A world (the simulator's `sim.policy`, the runtime's `runtime.scheduler_process`) only
turns its own state into those arguments and applies the decisions returned:

    submit(request)                    -> Stage      the queue the request now waits in
    drain(group_tokens)                -> tuple[GroupAssignment, ...]  DE phase 1
    de_fetch(group, reports)           -> DEFetch    DE phase 2 for one DE group
    pe_fetch(group, reports, read_q)   -> PEFetch    Algorithm 1 (or round robin) for one PE group
    cancel(request_id)                 -> Cancelled  drop a request still waiting

A request's path through the queues (`SchedulerParams.assignment_order`):

    DE first (default):  submit -> global -> drain -> private[g] -> de_fetch -> PE queue
                         -> pe_fetch (the read path is chosen here: both sides are known)
    PE first:            submit -> PE queue -> pe_fetch -> global -> drain -> private[g]
                         -> de_fetch (the read path is chosen here)

A fetch's decisions are a FIFO prefix of the queue it serves; the scheduler pops exactly those,
so the world never edits a queue itself. DE groups are numbered `0 .. num_de_groups-1` (a world
maps its own ids, e.g. decode node ids, onto them); PE group ids are the world's own.

The load charge: a request adds `SchedulerParams.de_tok_charge` to its DE group's load from the
moment phase 1 commits it to the group's private queue (`private_tokens`, added to the reported
`tok` of the group in the next drain) until a DE takes it, when the DE's own `tok` carries the
same charge (see `SchedulerParams`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from dualpath.core.errors import SpecError
from dualpath.sched import de, pe
from dualpath.sched.params import AssignmentOrder, SchedulerParams
from dualpath.sched.path import ReadSideChooser
from dualpath.sched.types import DEFetch, EngineReport, GroupAssignment, PEFetch, WaitingRequest


class Stage(str, Enum):
    """Where a waiting request is: the queue it waits in."""

    DE_GLOBAL = "de-global"
    """The global DE queue, until the next DE phase 1 (`drain`)."""
    DE_PRIVATE = "de-private"
    """A DE group's private queue, until that group's fetch binds a DE."""
    PE = "pe"
    """The FIFO PE queue, until a PE group's fetch binds a PE."""


@dataclass(frozen=True)
class Cancelled:
    """The decision of `Scheduler.cancel`: `stage` is where the request waited and was
    dropped from; None when it was not waiting (its engines have it, or it is unknown)."""

    request_id: int
    stage: Stage | None

    @property
    def was_waiting(self) -> bool:
        return self.stage is not None


class Scheduler:
    """Global DE queue, DE private queues and their charges, PE queue, round-robin cursors,
    policy family (`dualpath` or round robin), path mode and assignment order (`params`), and
    the read-side state (`sides`: the `balanced` tie counter and the round-robin coin, which
    take `read_nodes`, the (prefill, decode) nodes whose storage NICs read, and `seed`).

    Invariant, kept by every method: each submitted request that no fetch has yet bound to
    both its engines is in exactly one queue (global, one private, PE); `private_tokens[g]` is
    the sum of `de_tok_charge` over private queue g; `_de_node_of` (DE first) holds exactly the
    PE queue's requests and `_pe_node_of` (PE first) exactly those in the DE queues.
    """

    def __init__(self, params: SchedulerParams, num_de_groups: int,
                 is_round_robin: bool = False, *, read_nodes: tuple[int, int] = (1, 1),
                 seed: int = 0) -> None:
        if num_de_groups < 1:
            raise SpecError("scheduler", "num_de_groups", num_de_groups, "must be >= 1")
        self.params = params
        self.sides = ReadSideChooser(params, is_round_robin, read_nodes[0], read_nodes[1], seed)
        """How `dual`-mode reads pick their side (`path.ReadSideChooser`)."""
        self.is_round_robin = is_round_robin
        self.is_de_first = params.assignment_order is AssignmentOrder.DE_FIRST
        self.num_de_groups = num_de_groups
        self._global: list[WaitingRequest] = []
        self._private: list[deque[WaitingRequest]] = [deque() for _ in range(num_de_groups)]
        self.private_tokens: list[int] = [0] * num_de_groups
        """Sum of the DE charges of each private queue (committed to the group, in no `tok`)."""
        self._pe: deque[WaitingRequest] = deque()
        self._de_node_of: dict[int, int] = {}
        """DE first: request id -> node of its bound DE, for the requests in the PE queue."""
        self._pe_node_of: dict[int, int] = {}
        """PE first: request id -> node of its bound PE, for the requests in the DE queues."""
        self._rr_group = 0
        self._rr_de: list[int] = [0] * num_de_groups
        self._rr_pe: dict[int, int] = {}

    # -- views ---------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests in any queue."""
        return len(self._global) + sum(len(q) for q in self._private) + len(self._pe)

    @property
    def num_global(self) -> int:
        return len(self._global)

    @property
    def num_pe_waiting(self) -> int:
        return len(self._pe)

    def num_private(self, group: int) -> int:
        return len(self._private[group])

    def de_head(self, group: int) -> WaitingRequest | None:
        """The head of DE group `group`'s private queue (what its next fetch places first)."""
        q = self._private[group]
        return q[0] if q else None

    def de_charge(self, r: WaitingRequest) -> int:
        """What `r` adds to its DE's `tok` (and, before that, to its group's private load)."""
        return self.params.de_tok_charge.tokens(r)

    def pe_charge(self, r: WaitingRequest) -> int:
        """What `r` adds to its PE's `tok`."""
        return self.params.pe_tok_charge.tokens(r)

    # -- decisions -------------------------------------------------------------------------------
    def submit(self, request: WaitingRequest) -> Stage:
        """Queue a new request: the global DE queue (DE first) or the PE queue (PE first)."""
        if self.is_de_first:
            self._global.append(request)
            return Stage.DE_GLOBAL
        self._pe.append(request)
        return Stage.PE

    def drain(self, group_tokens: Sequence[int]) -> tuple[GroupAssignment, ...]:
        """DE phase 1: every request of the global queue to a DE group's private queue.

        `group_tokens[g]` is the sum of `tok` over group g's engines as the world sees it; the
        load balanced is that plus `private_tokens[g]` (the dualpath policy), or the groups in
        turn (round robin)."""
        queue = self._global
        if not queue:
            return ()
        if len(group_tokens) != self.num_de_groups:
            raise SpecError("scheduler", "group_tokens", len(group_tokens),
                            f"needs one load per DE group ({self.num_de_groups})")
        if self.is_round_robin:
            moved, self._rr_group = de.de_global_drain_round_robin(
                queue, range(self.num_de_groups), self._rr_group)
        else:
            private = self.private_tokens
            if len(queue) == 1:
                # A single arrival (the simulator's every call): `de_least_loaded_group` over
                # the loads (the minimum, ties to the lower index), without building them.
                best, best_load = 0, group_tokens[0] + private[0]
                for g in range(1, len(private)):
                    load = group_tokens[g] + private[g]
                    if load < best_load:
                        best, best_load = g, load
                moved = (GroupAssignment(queue[0].request_id, best),)
            else:
                loads = [t + p for t, p in zip(group_tokens, private, strict=True)]
                moved = de.de_global_drain(queue, dict(enumerate(loads)), self.params)
        charge = self.params.de_tok_charge
        for r, a in zip(queue, moved, strict=True):
            self._private[a.group_id].append(r)
            self.private_tokens[a.group_id] += charge.tokens(r)
        self._global = []
        return moved

    def de_fetch(
        self, group: int, reports: Sequence[EngineReport],
        read_q_tokens_by_node: Mapping[int, int] | None = None, is_validated: bool = False,
    ) -> DEFetch:
        """DE phase 2 for group `group` over its private queue; the assigned requests leave it
        (DE first: for the PE queue; PE first: bound to both engines, their read planned here
        from `read_q_tokens_by_node`, the PE nodes' read queues)."""
        queue = self._private[group]
        if not queue:
            return DEFetch((), 0.0, 0, {})
        pe_node_of = None if self.is_de_first else self._pe_node_of
        if self.is_round_robin:
            fetch, self._rr_de[group] = de.de_group_fetch_round_robin(
                queue, reports, self.params, self._rr_de[group], pe_node_of=pe_node_of,
                read_q_tokens_by_node=read_q_tokens_by_node, is_validated=is_validated,
                sides=self.sides)
        else:
            fetch = de.de_group_fetch(
                queue, reports, self.params, pe_node_of=pe_node_of,
                read_q_tokens_by_node=read_q_tokens_by_node, is_validated=is_validated,
                sides=self.sides)
        charge = self.params.de_tok_charge
        for a in fetch.assignments:
            r = queue.popleft()
            self.private_tokens[group] -= charge.tokens(r)
            if self.is_de_first:
                self._de_node_of[r.request_id] = a.node_id
                self._pe.append(r)
            else:
                del self._pe_node_of[r.request_id]
        return fetch

    def pe_fetch(
        self, group: int, reports: Sequence[EngineReport],
        read_q_tokens_by_node: Mapping[int, int] | None = None, is_validated: bool = False,
    ) -> PEFetch:
        """One PE group fetch over the PE queue; the assigned requests leave it (DE first:
        bound to both engines, their read planned here from `read_q_tokens_by_node`, the DE
        nodes' read queues; PE first: for the global DE queue)."""
        queue = self._pe
        if not queue:
            return PEFetch((), {})
        de_node_of = self._de_node_of if self.is_de_first else None
        if self.is_round_robin:
            fetch, self._rr_pe[group] = pe.pe_fetch_round_robin(
                queue, reports, self.params, self._rr_pe.get(group, 0), de_node_of=de_node_of,
                read_q_tokens_by_node=read_q_tokens_by_node, is_validated=is_validated,
                sides=self.sides)
        else:
            fetch = pe.pe_fetch(
                queue, reports, self.params, de_node_of=de_node_of,
                read_q_tokens_by_node=read_q_tokens_by_node, is_validated=is_validated,
                sides=self.sides)
        for a in fetch.assignments:
            r = queue.popleft()
            if self.is_de_first:
                del self._de_node_of[r.request_id]
            else:
                self._pe_node_of[r.request_id] = a.node_id
                self._global.append(r)
        return fetch

    def cancel(self, request_id: int) -> Cancelled:
        """Drop `request_id` from whichever queue holds it (its engines, if one is bound,
        are the world's to release); `Cancelled.stage` None if no queue does."""
        for i, r in enumerate(self._global):
            if r.request_id == request_id:
                del self._global[i]
                self._pe_node_of.pop(request_id, None)
                return Cancelled(request_id, Stage.DE_GLOBAL)
        for g, q in enumerate(self._private):
            for i, r in enumerate(q):
                if r.request_id == request_id:
                    del q[i]
                    self.private_tokens[g] -= self.params.de_tok_charge.tokens(r)
                    self._pe_node_of.pop(request_id, None)
                    return Cancelled(request_id, Stage.DE_PRIVATE)
        for i, r in enumerate(self._pe):
            if r.request_id == request_id:
                del self._pe[i]
                self._de_node_of.pop(request_id, None)
                return Cancelled(request_id, Stage.PE)
        return Cancelled(request_id, None)
