"""A turn's arrival and the inter-engine scheduling of the simulator's event handlers: the
turn queues at the scheduler, DE and PE groups fetch, and an assignment that carries a read plan
starts its reads (`Reads`). The handlers' shared state is set up here, at the bottom of the
chain `Dispatch` <- `Reads` <- `Prefill` <- `Handlers` (`sim.handlers` gives the whole flow);
a step handled higher up is declared here and defined there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from dualpath.sched.scheduler import Stage
from dualpath.sched.types import EngineReport, ReadPlan, Role, WaitingRequest
from dualpath.sim.config import SimConfig
from dualpath.sim.flows import FlowNet
from dualpath.sim.kernel import EventLoop
from dualpath.sim.sched_adapter import Policy
from dualpath.sim.state import Engine, Node, Req, TtftLog
from dualpath.sim.topology import Cluster

ProgressFn = Callable[[int], None]

ATTN_BIN_S: Final = 1.0
"""Width (simulated seconds) of the bins in which steps' attention Max/Avg is summed."""


class Dispatch:
    """The event handlers of one run and the state they share beyond the cluster's: the
    requests, the scheduler's adapter, the per-agent turn cursors and the run's statistics."""

    def __init__(self, config: SimConfig, cluster: Cluster, loop: EventLoop, net: FlowNet,
                 policy: Policy, progress: ProgressFn | None = None) -> None:
        self.cluster = cluster
        self.loop = loop
        self.net = net
        self.policy = policy
        self.sched = policy.sched
        self.decode_cap = policy.decode_cap
        """The cap at decode admission (`SimParams.decode_cap_at`); 0: none here."""
        self.progress = progress
        # Read by nearly every handler: bound here once.
        self.engines: list[Engine] = cluster.engines
        self.nodes: list[Node] = cluster.nodes
        self.kv_bpt = cluster.kv_bpt
        self.params = config.params
        # The mode's switches, read on every step (`Mode.is_oracle` is a property).
        self.is_oracle = config.mode.is_oracle
        self.is_layerwise = config.mode.is_layerwise
        self.is_hbm_gated = not self.is_layerwise and not self.is_oracle
        """Without layerwise prefill a PE-side read lands in the PE's HBM (`_next_read`)."""
        self.persist_waiters: dict[int, list[Callable[[], None]]] = {}
        """Per DE: next turns waiting for the persistence not yet started
        (`SimParams.is_next_turn_after_persist`)."""
        wl = config.workload
        self.wl_prompt: list[int] = wl.prompt_tokens.tolist()
        self.wl_hit: list[int] = wl.hit_tokens.tolist()
        self.wl_gen: list[int] = wl.gen_tokens.tolist()
        self.agent_rows: list[tuple[int, int]] = []
        """Per agent: its turns' rows in the workload, [lo, hi)."""
        self.agent_next: list[int] = []
        """Per agent: the row of its turn that arrives when the current one finishes."""
        self.reqs: list[Req] = []
        self.waiting: dict[int, WaitingRequest] = {}
        """The scheduler's view of every request not yet finished, by request id."""
        self._reports: list[EngineReport | None] = [None] * len(cluster.engines)
        """Each engine's last fetch report, None once its counters changed (by engine id: a
        list, not a dict, on the hot path)."""
        self.dgroup_tok = [0] * len(cluster.dgroups)
        """Sum of `tok` over each DE group's engines (DE phase 1 balances it)."""
        self.de_dirty: set[int] = set()
        """DE groups whose private queue or free HBM changed since their last fetch."""
        self.next_pgroup = 0
        self.de_read_q: dict[int, int] = dict.fromkeys(cluster.de_nodes, 0)
        """node -> read queue (tokens) of every DE node, kept equal to `Node.read_q_tokens`.
        A PE fetch reads it for the DE nodes of the requests it assigns; giving it every DE node
        (not only those of queued requests) changes no decision and copies in O(DE nodes)."""
        self.ttft = TtftLog()
        self.attn_bin_s: float = ATTN_BIN_S
        self.attn_bin_ratio: list[float] = []
        self.attn_bin_steps: list[int] = []
        """Per `ATTN_BIN_S` bin of step start times: the sum over synchronized prefill steps of
        max/mean attention time across the engines that ran in the step (paper Fig. 14), and
        the number of those steps."""
        self.attn_engines_ran = 0
        """Engines that ran, summed over the synchronized steps."""
        self.num_prefill_steps = 0
        self.prefill_compute_s = 0.0
        """Forward-pass time of every prefill step, summed over the prefill groups."""
        self.prefill_busy_s = 0.0
        """Wall time of every prefill step (its forward pass, and with layerwise prefill the
        KV it streams in and out; without, the load into HBM before it), summed over the
        prefill groups."""

    # -- arrival and inter-engine scheduling ---------------------------------------------------
    def add_agent(self, lo: int, hi: int, next_row: int) -> int:
        """A new agent whose turns are rows [lo, hi); `next_row` arrives when its first
        finishes (`hi`: none follows). Returns its id."""
        self.agent_rows.append((lo, hi))
        self.agent_next.append(next_row)
        return len(self.agent_rows) - 1

    def arrive(self, agent: int, row: int) -> None:
        """Turn `row` of `agent` arrives: the scheduler queues it (after the control plane's
        `SimParams.turn_dispatch_s`) and the engines fetch."""
        req = Req(len(self.reqs), agent, row, self.wl_prompt[row], self.wl_hit[row],
                  self.wl_gen[row], self.loop.now_s)
        self.reqs.append(req)
        w = WaitingRequest(req.request_id, req.prompt_tokens, req.hit_tokens, req.gen_tokens)
        self.waiting[req.request_id] = w
        delay = self.params.turn_dispatch_s
        if delay > 0.0:
            self.loop.after(delay, lambda: self._submit(w))
        else:
            self._submit(w)

    def _submit(self, w: WaitingRequest) -> None:
        if self.sched.submit(w) is Stage.PE:
            self._dispatch_pe()
        else:
            self._dispatch_de()

    def _group_reports(self, engine_ids: list[int], role: Role) -> list[EngineReport]:
        """The engines' fetch reports; each is reused while nothing in it changed (most
        engines of a group are untouched between two fetches).

        Invariant: every change of an engine's `num_seqs`, `num_tokens` or `free_hbm_bytes`
        drops its cached report (`_touch`), so only the node's read queue is compared here."""
        cache, engines, nodes = self._reports, self.engines, self.nodes
        out: list[EngineReport] = []
        for idx in engine_ids:
            e = engines[idx]
            old = cache[idx]
            read_q = nodes[e.node].read_q_tokens
            if old is None or old.read_q_tokens != read_q:
                old = EngineReport(idx, e.node, role, e.num_seqs, e.num_tokens, read_q,
                                   int(e.free_hbm_bytes))
                cache[idx] = old
            out.append(old)
        return out

    def _touch(self, engine_id: int) -> None:
        """Drop the cached report of an engine whose counters just changed."""
        self._reports[engine_id] = None

    def _dispatch_de(self) -> None:
        """Two-level DE scheduling: the global queue to groups, then a fetch by each group
        whose private queue or free HBM changed since its last fetch. A DE assignment that
        carries a read plan (PE first) starts its reads; the others wait for a PE."""
        sched = self.sched
        if sched.num_global:
            for g in sched.drain(self.dgroup_tok):
                self.de_dirty.add(g.group_id)
        moved = False
        params = sched.params
        dirty, self.de_dirty = sorted(self.de_dirty), set()
        dgroups = self.cluster.dgroups
        for gi in dirty:
            head = sched.de_head(gi)
            if head is None:
                continue
            grp = dgroups[gi]
            # Both DE policies end a fetch at once when the head fits no engine's free HBM
            # (reports carry int(free)) or every engine is at the sequence cap, with no state
            # change: skip building that fetch.
            need = params.hbm_bytes(head)
            engines = self.engines
            if all(int(engines[e].free_hbm_bytes) < need
                   or params.is_de_full(engines[e].num_seqs) for e in grp.engines):
                continue
            reports = self._group_reports(grp.engines, Role.DECODE)
            pe_read_q = None if sched.is_de_first else self._pe_read_q()
            fetch = sched.de_fetch(gi, reports, pe_read_q, True)
            for a in fetch.assignments:
                rid = a.request_id
                req = self.reqs[rid]
                eng = self.engines[a.engine_id]
                req.de_engine, req.hbm_bytes = a.engine_id, a.hbm_bytes
                req.de_assigned_at = self.loop.now_s
                eng.free_hbm_bytes -= a.hbm_bytes
                eng.num_seqs += 1
                charge = sched.de_charge(self.waiting[rid])
                eng.num_tokens += charge
                self._touch(a.engine_id)
                self.dgroup_tok[gi] += charge
                if a.read is None:
                    moved = True
                else:
                    self._start_reads(req, a.read)
        if moved:
            self._dispatch_pe()

    def _pe_read_q(self) -> dict[int, int]:
        """node -> read queue of every PE node (a PE-first DE fetch plans reads with it)."""
        return {nd.idx: nd.read_q_tokens for nd in self.nodes if nd.is_prefill}

    def _dispatch_pe(self) -> None:
        """PE groups fetch from the FIFO queue (Algorithm 1 or round robin), in turn: the
        group after the last one that fetched goes first, so no node is favoured. A PE
        assignment that carries a read plan (DE first) starts its reads; the others wait for
        a DE."""
        sched = self.sched
        pgroups = self.cluster.pgroups
        num = len(pgroups)
        beta = sched.params.beta_tokens
        moved = False
        for k in range(num):
            if not sched.num_pe_waiting:
                break
            grp = pgroups[(self.next_pgroup + k) % num]
            if all(self.engines[e].num_tokens > beta for e in grp.engines):
                continue  # every engine is overloaded: its fetch would return nothing
            reports = self._group_reports(grp.engines, Role.PREFILL)
            assigned = sched.pe_fetch(grp.idx, reports, self.de_read_q, True).assignments
            if assigned:
                self.next_pgroup = (grp.idx + 1) % num
            for a in assigned:
                req = self.reqs[a.request_id]
                eng = self.engines[a.engine_id]
                req.pe_engine, req.pe_assigned_at = a.engine_id, self.loop.now_s
                eng.num_seqs += 1
                eng.num_tokens += sched.pe_charge(self.waiting[req.request_id])
                self._touch(a.engine_id)
                if a.read is None:
                    moved = True
                else:
                    self._start_reads(req, a.read)
        if moved:
            self._dispatch_de()

    # -- defined higher up the chain, declared for the calls above ----------
    def _start_reads(self, req: Req, plan: ReadPlan | None) -> None:
        """Queue the request's reads at its nodes (`Reads._start_reads`)."""
        raise NotImplementedError

