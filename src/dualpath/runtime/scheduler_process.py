"""The scheduler process: the runtime's adapter around `dualpath.sched.scheduler.Scheduler`
(which owns the queues, their charges and the round-robin cursors, as it does for the
simulator), driven by the group leaders' fetches (pull, paper §6.1).

Order (DE first, the only one the runtime runs: a PE's `PrefillTask` names its DE): a submitted
turn enters the global DE queue; a decode group's fetch drains it to the groups' private queues
(phase 1) and binds DEs from its own private queue (phase 2, HBM admission and the `Z`
threshold); bound requests join the FIFO PE queue; a prefill group's fetch runs Algorithm 1,
which also chooses each request's read path (`ReadPlan`) now that both sides are known. The PE
gets its `PrefillTask` in that fetch's reply, the DE its `DecodeTask` in the reply to its own
next fetch. Each node is one engine group; DE group `k` of the scheduler is decode node `P + k`.

Between a DE binding and the DE node learning of it, the node's own report does not include the
request yet, so the scheduler adds what it has bound but not delivered (HBM, `seq`, `tok`) to
that engine's report: a DE is never promised more HBM than it has.

`RuntimeScheduler` does no I/O (`on_fetch` returns the reply, so it is tested without
processes); `serve_scheduler` is the scheduler process around it: it owns the queues, answers
the group leaders' fetches (long poll) and forwards to the driver what the driver needs.
"""

from __future__ import annotations

import queue
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass

from dualpath.core.errors import SpecError
from dualpath.core.validate import positive_int
from dualpath.runtime.messages import (
    Cancel,
    DecodeTask,
    EngineLoad,
    Fetch,
    Fetched,
    Inbox,
    Message,
    NodeFailed,
    NodeStats,
    NodeUp,
    PrefillTask,
    SchedulerStats,
    Shutdown,
    Submitted,
    TurnDone,
    TurnTokens,
    is_parent_gone,
)
from dualpath.sched.params import AssignmentOrder, SchedulerParams, TokCharge
from dualpath.sched.scheduler import Scheduler
from dualpath.sched.types import EngineReport, ReadPlan, Role


@dataclass(frozen=True)
class SchedulerConfig:
    """Cluster shape and policy. Nodes `[0, P)` prefill, `[P, P+D)` decode; node n holds
    engines `n*g .. n*g+g-1`; each node is one engine group (its first engine leads)."""

    params: SchedulerParams
    num_prefill_nodes: int
    num_decode_nodes: int
    engines_per_node: int
    is_round_robin: bool = False
    """Basic's "w/o scheduling": round robin over engines and DE groups."""
    forced_read_side: str | None = None
    """"de": read every hit on the DE side whatever the policy says (tests of the DE path)."""
    seed: int = 0
    """Seed of the scheduler's read-side coin (`SchedulerParams.rr_read_side` `random`)."""

    def __post_init__(self) -> None:
        positive_int("scheduler", "num_prefill_nodes", self.num_prefill_nodes)
        positive_int("scheduler", "num_decode_nodes", self.num_decode_nodes)
        positive_int("scheduler", "engines_per_node", self.engines_per_node)
        if self.params.assignment_order is not AssignmentOrder.DE_FIRST:
            raise SpecError("scheduler", "assignment_order", self.params.assignment_order.value,
                            "the runtime binds DEs first (a PE's task names its DE)")
        for name in ("pe_tok_charge", "de_tok_charge"):
            # The engines report `tok` as their requests' prompt tokens (prefill_engine,
            # decode_engine): a scheduler charging anything else would mix two units in one load.
            if getattr(self.params, name) is not TokCharge.PROMPT:
                raise SpecError("scheduler", name, getattr(self.params, name).value,
                                "the runtime's engines count prompt tokens: must be prompt")

    def is_prefill_node(self, node: int) -> bool:
        return node < self.num_prefill_nodes

    @property
    def decode_nodes(self) -> range:
        return range(self.num_prefill_nodes, self.num_prefill_nodes + self.num_decode_nodes)


__all__ = ["RuntimeScheduler", "SchedulerConfig", "Submitted", "serve_scheduler"]


@dataclass
class _Binding:
    de_engine: int
    de_node: int
    hbm_bytes: int


class RuntimeScheduler:
    """The `Scheduler` and what only the runtime has: submitted turns' tokens, DE bindings not
    yet delivered, the DE nodes' outboxes; `submit` turns, answer `Fetch`es."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.sched = Scheduler(cfg.params, cfg.num_decode_nodes, is_round_robin=cfg.is_round_robin,
                               read_nodes=(cfg.num_prefill_nodes, cfg.num_decode_nodes),
                               seed=cfg.seed)
        self._submitted: dict[int, Submitted] = {}
        self._bound: dict[int, _Binding] = {}
        self._undelivered: dict[int, list[int]] = defaultdict(list)
        """DE engine -> requests bound to it that its node has not received yet."""
        self._outbox: dict[int, list[DecodeTask]] = defaultdict(list)
        self._loads: dict[int, tuple[EngineLoad, ...]] = {}
        self.num_fetches = 0

    @property
    def num_waiting(self) -> int:
        """Submitted requests not yet handed to both their engines."""
        return self.sched.num_waiting + sum(len(v) for v in self._outbox.values())

    def submit(self, turn: Submitted) -> None:
        r = turn.request
        if r.request_id in self._submitted:
            raise SpecError("scheduler", "request_id", r.request_id, "submitted twice")
        bs = self.cfg.params.block_size_tokens
        if r.hit_tokens % bs or len(turn.turn.block_keys) * bs > r.prompt_tokens:
            raise SpecError("scheduler", "hit_tokens", r.hit_tokens, "not block aligned")
        self._submitted[r.request_id] = turn
        self.sched.submit(r)

    def finished(self, request_id: int) -> None:
        """Forget a completed request."""
        self._submitted.pop(request_id, None)
        self._bound.pop(request_id, None)

    def cancel(self, request_id: int) -> tuple[str, int]:
        """Stop a request early: `("dropped", -1)` while no engine has it (the caller reports
        it done), `("forward", de_node)` once its engines have it (the DE ends it),
        `("unknown", -1)` for a request already done or never submitted."""
        if request_id not in self._submitted:
            return "unknown", -1
        if self.sched.cancel(request_id).was_waiting:
            bound = self._bound.get(request_id)
            if bound is not None:
                self._undelivered[bound.de_engine].remove(request_id)
            self.finished(request_id)
            return "dropped", -1
        return "forward", self._bound[request_id].de_node

    # -- fetches ---------------------------------------------------------------------------
    def on_fetch(self, fetch: Fetch) -> Fetched:
        """Run the policy for the fetching group (one node) and build its reply."""
        self.num_fetches += 1
        self._loads[fetch.node] = fetch.loads
        if self.cfg.is_prefill_node(fetch.node):
            return Fetched(prefill=self._pe_fetch(fetch))
        self._de_fetch(fetch)
        tasks = tuple(self._outbox.pop(fetch.node, []))
        for t in tasks:
            self._undelivered[t.de_engine].remove(t.request_id)
        return Fetched(decode=tasks)

    def _read_q_by_node(self) -> dict[int, int]:
        """Each node's last reported read queue plus the DE-side reads planned for it that it
        has not received yet (they join its queue on its next fetch)."""
        bs = self.cfg.params.block_size_tokens
        q = {n: loads[0].read_q_tokens for n, loads in self._loads.items() if loads}
        for node, tasks in self._outbox.items():
            planned = sum((t.turn.num_hit_blocks - t.num_pe_blocks) * bs for t in tasks)
            q[node] = q.get(node, 0) + planned
        return q

    def _reports(self, node: int, role: Role) -> list[EngineReport]:
        reports = []
        for load in self._loads[node]:
            pending = [self._bound[r] for r in self._undelivered.get(load.engine_id, [])]
            extra_tok = sum(
                self.sched.de_charge(self._submitted[r].request)
                for r in self._undelivered.get(load.engine_id, [])
            )
            reports.append(
                EngineReport(
                    engine_id=load.engine_id,
                    node_id=node,
                    role=role,
                    num_seqs=load.num_seqs + len(pending),
                    num_tokens=load.num_tokens + extra_tok,
                    read_q_tokens=load.read_q_tokens,
                    free_hbm_bytes=max(0, load.free_hbm_bytes - sum(b.hbm_bytes for b in pending)),
                )
            )
        return reports

    def _de_fetch(self, fetch: Fetch) -> None:
        cfg, sched, node = self.cfg, self.sched, fetch.node
        if sched.num_global:
            # Phase 1 balances the groups' `tok` as last reported (plus what the scheduler
            # has bound to them since); a group that never reported counts 0.
            sched.drain([
                sum(r.num_tokens for r in self._reports(g, Role.DECODE)) if g in self._loads
                else 0
                for g in cfg.decode_nodes
            ])
        group = node - cfg.num_prefill_nodes
        if not sched.num_private(group):
            return
        result = sched.de_fetch(group, self._reports(node, Role.DECODE))
        for d in result.assignments:
            self._bound[d.request_id] = _Binding(d.engine_id, d.node_id, d.hbm_bytes)
            self._undelivered[d.engine_id].append(d.request_id)

    def _pe_fetch(self, fetch: Fetch) -> tuple[PrefillTask, ...]:
        if not self.sched.num_pe_waiting:
            return ()
        reports = self._reports(fetch.node, Role.PREFILL)
        result = self.sched.pe_fetch(fetch.node, reports, self._read_q_by_node())
        tasks = []
        for a in result.assignments:
            turn = self._submitted[a.request_id]
            bound = self._bound[a.request_id]
            plan = a.read
            if plan is None:
                raise RuntimeError(f"request {a.request_id}: no read plan with a bound DE")
            if plan.num_hit_blocks != turn.turn.num_hit_blocks:
                raise RuntimeError(f"request {a.request_id}: read plan of {plan.num_hit_blocks} "
                                   f"hit blocks for a turn of {turn.turn.num_hit_blocks}")
            if self.cfg.forced_read_side == "de":
                plan = ReadPlan(
                    plan.pe_node_id, plan.de_node_id, plan.num_hit_blocks, 0, plan.block_size_tokens
                )
            tasks.append(self._prefill_task(turn, a.engine_id, bound, plan))
            self._outbox[bound.de_node].append(self._decode_task(turn, fetch.node, bound, plan))
        return tuple(tasks)

    def _prefill_task(
        self, turn: Submitted, pe_engine: int, bound: _Binding, plan: ReadPlan
    ) -> PrefillTask:
        return PrefillTask(
            request_id=turn.request.request_id,
            pe_engine=pe_engine,
            de_node=bound.de_node,
            de_engine=bound.de_engine,
            turn=turn.turn,
            num_pe_blocks=plan.num_pe_blocks,
            sampling=turn.sampling,
        )

    def _decode_task(
        self, turn: Submitted, pe_node: int, bound: _Binding, plan: ReadPlan
    ) -> DecodeTask:
        return DecodeTask(
            request_id=turn.request.request_id,
            de_engine=bound.de_engine,
            pe_node=pe_node,
            turn=turn.turn,
            num_pe_blocks=plan.num_pe_blocks,
            sampling=turn.sampling,
            is_streaming=turn.is_streaming,
        )


SCHEDULER_NODE = -1
"""`NodeFailed.node` of a scheduler failure."""


def serve_scheduler(
    cfg: SchedulerConfig,
    inbox: Inbox,
    nodes: dict[int, Inbox],
    driver: Inbox,
    max_park_s: float = 0.05,
) -> None:
    """The scheduler process (or thread): serve until `Shutdown`, then send `SchedulerStats`.

    Messages in: `Submitted` and `Cancel` (driver), `Fetch` (group leaders), `TurnDone` and
    `TurnTokens` (DE nodes), and the nodes' `NodeUp` / `NodeStats` / `NodeFailed`, which go on
    to the driver. A fetch that finds
    no work is parked and retried whenever something changes, and answered empty after
    `max_park_s` so the node's report stays fresh: fetches stay pull-based without the nodes
    polling in a busy loop. Any exception is reported to the driver as `NodeFailed(-1, ...)`.
    """
    try:
        _serve(RuntimeScheduler(cfg), inbox, nodes, driver, max_park_s)
    except BaseException as exc:  # the driver must learn why the scheduler died
        text = " ".join(str(exc).split())
        error = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        driver.put(NodeFailed(SCHEDULER_NODE, error, traceback.format_exc(limit=8)))


def _serve(
    sched: RuntimeScheduler,
    inbox: Inbox,
    nodes: dict[int, Inbox],
    driver: Inbox,
    max_park_s: float,
) -> None:
    parked: dict[int, tuple[float, Fetch]] = {}

    def answer(fetch: Fetch, parked_at: float) -> None:
        reply = sched.on_fetch(fetch)
        if reply.prefill or reply.decode or time.monotonic() - parked_at >= max_park_s:
            parked.pop(fetch.node, None)
            nodes[fetch.node].put(reply)
        else:
            parked[fetch.node] = (parked_at, fetch)

    while True:
        msg: Message | None
        try:
            msg = inbox.get(timeout=max_park_s / 2 if parked else 1.0)
        except queue.Empty:
            if not parked and is_parent_gone():
                return  # orphaned: the driver died without sending Shutdown
            msg = None
        if isinstance(msg, Shutdown):
            driver.put(SchedulerStats(sched.num_fetches))
            return
        if isinstance(msg, Submitted):
            sched.submit(msg)
        elif isinstance(msg, Fetch):
            answer(msg, time.monotonic())
        elif isinstance(msg, TurnDone):
            sched.finished(msg.request_id)
            driver.put(msg)
        elif isinstance(msg, Cancel):
            outcome, de_node = sched.cancel(msg.request_id)
            if outcome == "dropped":
                driver.put(TurnDone(msg.request_id, (), 0.0, time.time()))
            elif outcome == "forward":
                nodes[de_node].put(msg)
        elif isinstance(msg, TurnTokens | NodeUp | NodeStats | NodeFailed):
            driver.put(msg)
        elif msg is not None:
            raise RuntimeError(f"scheduler: unexpected message {type(msg).__name__}")
        just_parked = msg.node if isinstance(msg, Fetch) else None
        for at, fetch in list(parked.values()):
            if fetch.node != just_parked:
                answer(fetch, at)
