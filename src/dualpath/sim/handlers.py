"""What happens to a turn, event by event, from arrival to its last token: the simulator's
event handlers (paper Fig. 4 and §4.2).

    arrive -> (turn_dispatch_s) -> sched.submit -> _dispatch_de / _dispatch_pe
                                                                 both engines bound (sched)
      -> _start_reads -> _next_read (storage NIC read server) -> _read_done
      -> _try_prefill (one step per prefill group) -> _step_part_done -> _prefill_done
      -> [_admit: the cap at decode admission, SimParams.decode_cap_at = decode]
      -> _next_copy (DE buffer -> HBM) -> _join_decode -> _decode_event -> _finish
         (-> _persist of the new Full Blocks; the agent's next turn arrives, after
         turn_return_s)

Hops and the links they load (bytes per request; `H` hit KV, `X` miss KV of a chunk; the PE side
reads `H_p`, the DE side `H_d`, `H = H_p + H_d`):

    storage read     SNIC read + DRAM of the reading node (+ storage-cluster cap)   H_p | H_d
    PE path in       PE DRAM, PE CNIC read (3), PE CNIC write (4)                    H_p
    PE path out      PE CNIC read (5), DE CNIC write (7), DE DRAM                    H_p
    DE path in       DE DRAM, DE CNIC read (3), PE CNIC write (5)                    H_d
    miss KV out      PE CNIC read, DE CNIC write, DE DRAM                            X
    DE copy-in       DE DRAM, DE CNIC read (8|6), DE CNIC write (9|7)                H + X
    persistence      DE CNIC read + write (D2H), DE DRAM x2, SNIC write              new blocks

Forward passes: a prefill group runs one step at a time; a step's length is the slowest engine's
attention plus the shared FFN, and with layerwise prefill the step's KV streaming is one flow
overlapped with compute (the step ends when both parts are done, `StepPart`). Without it, the
hit KV is loaded before compute and the KV goes out after it. Decode groups run continuous
batching in epochs between membership changes: within an epoch the step time is constant, so
completions are computed, not stepped.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Final

from dualpath.sched import cost as costmod
from dualpath.sched.scheduler import Stage
from dualpath.sched.types import EngineReport, ReadPlan, Role, WaitingRequest
from dualpath.sim.config import SimConfig
from dualpath.sim.flows import Flow, FlowNet, Link
from dualpath.sim.kernel import EventLoop
from dualpath.sim.sched_adapter import Policy
from dualpath.sim.state import (
    DecodeGroup,
    Engine,
    Node,
    PrefillGroup,
    Req,
    StepPart,
    TtftLog,
)
from dualpath.sim.topology import Cluster

ProgressFn = Callable[[int], None]

ATTN_BIN_S: Final = 1.0
"""Width (simulated seconds) of the bins in which steps' attention Max/Avg is summed."""


class Handlers:
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
        self.persist_waiters: dict[int, list[Callable[[], None]]] = {}
        """Per DE: next turns waiting for the persistence not yet started
        (`SimParams.is_next_turn_after_persist`)."""
        """Without layerwise prefill a PE-side read lands in the PE's HBM (`_next_read`)."""
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

    # -- storage reads --------------------------------------------------------------------------
    def _start_reads(self, req: Req, plan: ReadPlan | None) -> None:
        pe_tokens = plan.pe_read_tokens if plan is not None else req.hit_tokens
        de_tokens = plan.de_read_tokens if plan is not None else 0
        req.pe_read_tokens, req.de_read_tokens = pe_tokens, de_tokens
        if self.is_oracle:
            self._read_done(req)
            return
        for tokens, node in ((pe_tokens, self.engines[req.pe_engine].node),
                             (de_tokens, self.engines[req.de_engine].node)):
            if tokens > 0:
                req.num_reads_left += 1
                nd = self.nodes[node]
                nd.read_fifo.append((req, tokens))
                nd.read_q_tokens += tokens
                if not nd.is_prefill:
                    self.de_read_q[nd.idx] = nd.read_q_tokens
                self._next_read(nd)
        if req.num_reads_left == 0:
            self._read_done(req)

    def _next_read(self, nd: Node) -> None:
        """The node's read server (`Node.read_slots`): queued reads start in queue order while
        a slot is free, each a flow at the storage NIC's (calibrated) read rate, so reads in
        flight together share it (one slot, the `fifo` discipline: one read at a time at the
        whole rate). A read starts only when the node buffer has room for it (or the buffer is
        empty). Without layerwise prefill a PE-side read lands in its engine's HBM, so it also
        waits for room there (`_first_hbm_fit`); reads of engines with room go first
        meanwhile."""
        while nd.read_fifo and nd.can_start_read():
            if not self._start_read(nd):
                return

    def _start_read(self, nd: Node) -> bool:
        """Start the node's next read that may start (`_next_read`); False if none may."""
        pick = self._first_hbm_fit(nd) if self.is_hbm_gated and nd.is_prefill else 0
        if pick < 0:
            return False  # retried when a request of this node leaves its PE's HBM
        req, tokens = nd.read_fifo[pick]
        nbytes = tokens * self.kv_bpt
        if nd.buffer_used_bytes > 0 and nd.buffer_used_bytes + nbytes > nd.buffer_bytes:
            return False  # retried when the buffer frees
        if pick == 0:
            nd.read_fifo.popleft()
        else:
            del nd.read_fifo[pick]
        if self.is_hbm_gated and nd.is_prefill:
            pe = self.engines[req.pe_engine]
            req.pe_held_bytes = req.prompt_tokens * self.kv_bpt
            pe.held_kv_bytes += req.pe_held_bytes
            pe.peak_held_kv_bytes = max(pe.peak_held_kv_bytes, pe.held_kv_bytes)
        nd.num_reading += 1
        nd.take_buffer(nbytes)
        links: list[tuple[Link, float]] = [(nd.snic_read, 1.0), (nd.dram, 1.0)]
        storage_link = self.cluster.storage_link
        if storage_link is not None:
            links.append((storage_link, 1.0))
        stream_cap = self.cluster.read_stream_cap_bytes_per_s
        if stream_cap > 0.0:  # this request's own streams (a link only its read uses; one
            # time bin, as nothing reads its utilization series)
            links.append((Link("read_streams", "read_streams", nd.idx, stream_cap,
                               math.inf), 1.0))

        def done() -> None:
            nd.num_reading -= 1
            nd.read_q_tokens -= tokens
            if not nd.is_prefill:
                self.de_read_q[nd.idx] = nd.read_q_tokens
            nd.read_tokens_total += tokens
            req.num_reads_left -= 1
            if req.num_reads_left == 0:
                self._read_done(req)
            self._next_read(nd)

        self.net.start(Flow(links, nbytes, done))
        return True

    def _first_hbm_fit(self, nd: Node) -> int:
        """Index of the first queued read whose PE has HBM room for the request's whole KV
        (or holds none), -1 if none has; the walk stops once every engine of the node is
        known to be full."""
        room, kv, engines = self.cluster.pe_hbm_kv_bytes, self.kv_bpt, self.engines
        full: set[int] = set()
        for i, (req, _) in enumerate(nd.read_fifo):
            if req.pe_engine in full:
                continue
            held = engines[req.pe_engine].held_kv_bytes
            if held <= 0.0 or held + req.prompt_tokens * kv <= room:
                return i
            full.add(req.pe_engine)
            if len(full) == len(nd.engines):
                break
        return -1

    def _release_hbm(self, req: Req) -> None:
        """A non-layerwise request's KV has left its PE's HBM: a waiting read may start."""
        if req.pe_held_bytes <= 0.0:
            return  # no PE-side read (no hits, or read on the DE side)
        eng = self.engines[req.pe_engine]
        eng.held_kv_bytes -= req.pe_held_bytes
        req.pe_held_bytes = 0.0
        self._next_read(self.nodes[eng.node])

    def _free_buffer(self, nd: Node, nbytes: float) -> None:
        nd.buffer_used_bytes -= nbytes
        if nd.read_fifo and nd.can_start_read():
            self._next_read(nd)

    def _read_done(self, req: Req) -> None:
        req.read_done_at = self.loop.now_s
        self.engines[req.pe_engine].ready.append(req)
        self._try_prefill(self.cluster.pgroup_of[req.pe_engine])

    # -- prefill ----------------------------------------------------------------------------------
    def _record_attention_balance(self, now: float, ran_n: int, ran_sum: float,
                                  ran_max: float) -> None:
        """Account one synchronized step's attention Max/Avg across the `ran_n` engines that
        had work in it (those without join the step but are not counted: paper Fig. 14)."""
        if ran_n <= 0 or ran_sum <= 0.0:
            return
        b = int(now / self.attn_bin_s)
        bins, steps = self.attn_bin_ratio, self.attn_bin_steps
        if len(bins) <= b:
            bins.extend([0.0] * (b + 1 - len(bins)))
            steps.extend([0] * (b + 1 - len(steps)))
        bins[b] += ran_max * ran_n / ran_sum
        steps[b] += 1
        self.attn_engines_ran += ran_n

    def _try_prefill(self, grp: PrefillGroup) -> None:
        """Start the group's next step if it is idle and any of its engines has work."""
        if grp.is_busy:
            return
        cl = self.cluster
        model, hw, coeffs = cl.model, cl.hw, cl.coeffs
        step: list[tuple[Req, int]] = []
        attn: list[float] = []
        total_new = 0
        ran_n = 0  # engines with work in this step, and their attention times' sum and max
        ran_sum = 0.0
        ran_max = 0.0
        for e in grp.engines:
            eng = self.engines[e]
            if not eng.ready:
                attn.append(cl.attn_fixed_s)  # an idle engine still joins the synchronized step
                continue
            pairs = []
            for req, n in self.policy.pack(eng.ready, cl.pe_hbm_kv_bytes, self.is_layerwise):
                step.append((req, n))
                pairs.append((req.cached_tokens, n))
                total_new += n
            attn_s = (costmod.prefill_attention_time_s(model, hw, pairs, coeffs)
                      if cl.step_costs is None else cl.step_costs.prefill_pass_time_s(pairs))
            attn.append(attn_s)
            if pairs:
                ran_n += 1
                ran_sum += attn_s
                ran_max = max(ran_max, attn_s)
        if not step:
            return
        grp.is_busy = True
        grp.step = step
        now = self.loop.now_s
        for req, _ in step:
            if req.prefill_started_at < 0:
                req.prefill_started_at = now
        if cl.step_costs is not None:  # a measured pass is the whole pass (no FFN phase)
            compute_s = max(attn)
        elif cl.is_sync:
            per_engine = total_new / len(grp.engines)
            compute_s = max(attn) + costmod.prefill_ffn_time_s(model, hw, per_engine, coeffs)
            self._record_attention_balance(now, ran_n, ran_sum, ran_max)
        else:
            compute_s = attn[0] + costmod.prefill_ffn_time_s(model, hw, total_new, coeffs)
        if cl.step_costs is None:
            compute_s += coeffs.per_step_overhead_s
        self.num_prefill_steps += 1
        self.prefill_compute_s += compute_s
        grp.started_at = now
        self._set_forward_load(grp.engines, True)
        if self.is_oracle:
            grp.compute_pending = True
            self.loop.after(compute_s, lambda: self._step_part_done(grp, StepPart.COMPUTE))
            return
        inbound, outbound = self._step_bytes(step)
        if self.is_layerwise:
            grp.compute_pending = True
            grp.kv_flow_pending = True
            self.loop.after(compute_s, lambda: self._step_part_done(grp, StepPart.COMPUTE))
            merged = dict(inbound)
            for link, w in outbound.items():
                merged[link] = merged.get(link, 0.0) + w
            self.net.start(Flow(merged.items(), 1.0,
                                lambda: self._step_part_done(grp, StepPart.KV_FLOW)))
        else:
            # Basic: the hit KV of the batch is loaded into HBM before compute starts; the
            # prompt KV goes to the DE buffers after compute (the PE moves on meanwhile).
            def compute() -> None:
                grp.compute_pending = True
                self.loop.after(compute_s, lambda: self._step_part_done(grp, StepPart.COMPUTE))

            grp.kv_flow_pending = False
            self.net.start(Flow(inbound.items(), 1.0, compute))
            grp.outbound = outbound

    def _step_bytes(
        self, step: list[tuple[Req, int]]
    ) -> tuple[dict[Link, float], dict[Link, float]]:
        """Bytes each link carries for this forward step: into PE HBM, and out to DE buffers."""
        kv = self.kv_bpt
        inb: dict[Link, float] = {}
        out: dict[Link, float] = {}
        engines, nodes = self.engines, self.nodes
        # Adds inlined (a hot loop); a link enters a dict only with bytes > 0, and in this
        # order, which fixes the flow's link order.
        for req, n in step:
            pe = engines[req.pe_engine]
            de = engines[req.de_engine]
            pe_dram = nodes[pe.node].dram
            de_dram = nodes[de.node].dram
            miss = n * kv
            if req.computed_tokens == 0:  # first chunk: the hits stream in (and out, PE path)
                hp = req.pe_read_tokens * kv
                hd = req.de_read_tokens * kv
                if hp > 0:
                    inb[pe_dram] = inb.get(pe_dram, 0.0) + hp
                    inb[pe.cnic_read] = inb.get(pe.cnic_read, 0.0) + hp
                both = hp + hd
                if both > 0:
                    inb[pe.cnic_write] = inb.get(pe.cnic_write, 0.0) + both
                if hd > 0:
                    inb[de_dram] = inb.get(de_dram, 0.0) + hd
                    inb[de.cnic_read] = inb.get(de.cnic_read, 0.0) + hd
                miss += hp
            if miss > 0:
                out[pe.cnic_read] = out.get(pe.cnic_read, 0.0) + miss
                out[de.cnic_write] = out.get(de.cnic_write, 0.0) + miss
                out[de_dram] = out.get(de_dram, 0.0) + miss
        return inb, out

    def _set_forward_load(self, engines: list[int], is_busy: bool) -> None:
        """While the engines run a forward pass, inference traffic holds the compute NICs'
        high-priority class: KV flows get what is left (at least `kv_min_share`)."""
        f = self.params.inference_load_fraction
        if f <= 0.0:
            return
        share = max(self.params.kv_min_share, 1.0 - f) if is_busy else 1.0
        cap = self.cluster.cnic_bytes_per_s * share
        for e in engines:
            eng = self.engines[e]
            self.net.set_capacity(eng.cnic_read, cap)
            self.net.set_capacity(eng.cnic_write, cap)

    def _step_part_done(self, grp: PrefillGroup, part: StepPart) -> None:
        """One part of the group's step ended; once none is pending the step ends: buffers
        free, finished prompts go to their DEs, and the group starts its next step."""
        if part is StepPart.COMPUTE:
            grp.compute_pending = False
        else:
            grp.kv_flow_pending = False
        if grp.compute_pending or grp.kv_flow_pending:
            return
        self._set_forward_load(grp.engines, False)
        step, grp.step = grp.step, []
        outbound, grp.outbound = grp.outbound, None
        finished: list[Req] = []
        for req, n in step:
            if req.computed_tokens == 0 and req.pe_read_tokens and not self.is_oracle:
                self._free_buffer(self.nodes[self.engines[req.pe_engine].node],
                                  req.pe_read_tokens * self.kv_bpt)
            req.computed_tokens += n
            if req.remaining_tokens <= 0:
                finished.append(req)
                eng = self.engines[req.pe_engine]
                eng.ready.remove(req)
                eng.num_seqs -= 1
                eng.num_tokens -= self.policy.pe_charge(self.waiting[req.request_id])
                self._touch(req.pe_engine)
        grp.is_busy = False
        self.prefill_busy_s += self.loop.now_s - grp.started_at
        if outbound:
            # Basic: every request of the step waits for the step's KV transfer to the DEs.
            def sent() -> None:
                for r in finished:
                    if self.is_hbm_gated:
                        self._release_hbm(r)
                    self._prefill_done(r)

            self.net.start(Flow(outbound.items(), 1.0, sent))
        else:
            for req in finished:
                if self.is_hbm_gated:
                    self._release_hbm(req)
                self._prefill_done(req)
        self._try_prefill(grp)
        if finished:
            self._dispatch_pe()

    def _prefill_done(self, req: Req) -> None:
        """The prompt KV is in the DE buffer and the first token exists: copy in, decode (with
        the cap at decode admission, once the DE has a place under it)."""
        req.prefill_done_at = self.loop.now_s
        self.ttft.add(req.arrived_at, req.prefill_done_at)
        de = self.engines[req.de_engine]
        if self.decode_cap:
            de.admit_fifo.append(req)
            self._admit(de)
        else:
            self._enter_decode(req, de)

    def _admit(self, de: Engine) -> None:
        """Admit prefilled turns to decode, FIFO, while the DE has a place under the cap."""
        while de.admit_fifo and de.num_admitted < self.decode_cap:
            de.num_admitted += 1
            self._enter_decode(de.admit_fifo.popleft(), de)

    def _enter_decode(self, req: Req, de: Engine) -> None:
        """The turn goes on to decode: straight in (Oracle), else through its DE's copy-in."""
        if self.is_oracle:
            self._join_decode(req)
            return
        de.copy_fifo.append(req)
        self._next_copy(de)

    # -- copy-in and persistence -----------------------------------------------------------------
    def _next_copy(self, de: Engine) -> None:
        """A DE copies prompts from its buffer into HBM one at a time (FIFO), each at the
        rate its CNIC and the node DRAM give it."""
        if de.is_copying or not de.copy_fifo:
            return
        req = de.copy_fifo.popleft()
        de.is_copying = True
        nd = self.nodes[de.node]
        nbytes = req.prompt_tokens * self.kv_bpt

        def copied() -> None:
            de.is_copying = False
            if req.de_read_tokens:
                self._free_buffer(nd, req.de_read_tokens * self.kv_bpt)
            self._join_decode(req)
            self._next_copy(de)

        self.net.start(Flow([(nd.dram, nbytes), (de.cnic_read, nbytes), (de.cnic_write, nbytes)],
                            1.0, copied))

    def _after_persist(self, req: Req, de: Engine) -> None:
        """The agent's next turn (if any) arrives once `de`'s next persistence, which carries
        this turn's blocks, is done; until then the DEs are dispatched as at a last turn."""
        agent = req.agent
        nxt = self.agent_next[agent]
        if nxt < self.agent_rows[agent][1]:
            self.agent_next[agent] = nxt + 1
            self.persist_waiters.setdefault(de.idx, []).append(
                lambda: self._next_turn(agent, nxt))
        self._dispatch_de()

    def _next_turn(self, agent: int, row: int) -> None:
        """The agent's turn `row` follows a finished one: it arrives after the control
        plane's `SimParams.turn_return_s`."""
        delay = self.params.turn_return_s
        if delay > 0.0:
            self.loop.after(delay, lambda: self.arrive(agent, row))
        else:
            self.arrive(agent, row)

    def _persist(self, de: Engine, nbytes: float) -> None:
        """New Full Blocks go GPU -> DE buffer (D2H through the CNIC) -> storage NIC. One
        transfer per DE at a time; blocks finished meanwhile go together in the next one."""
        de.persist_pending_bytes += nbytes
        if de.is_persisting:
            return
        total, de.persist_pending_bytes = de.persist_pending_bytes, 0.0
        de.is_persisting = True
        nd = self.nodes[de.node]
        waiters = self.persist_waiters.pop(de.idx, None)

        def persisted() -> None:
            de.is_persisting = False
            if de.persist_pending_bytes > 0:
                self._persist(de, 0.0)
            if waiters is not None:
                for arrive in waiters:
                    arrive()

        self.net.start(Flow(
            [(de.cnic_read, 1.0), (de.cnic_write, 1.0), (nd.dram, 2.0), (nd.snic_write, 1.0)],
            total, persisted))

    # -- decode ------------------------------------------------------------------------------------
    def _join_decode(self, req: Req) -> None:
        """The prompt is in DE HBM: it joins its group's batch from the next step on (a new
        epoch: the step time changes)."""
        now = self.loop.now_s
        req.decode_joined_at = now
        if req.gen_tokens <= 1:
            self._finish(req)
            return
        grp = self.cluster.dgroup_of[req.de_engine]
        s = grp.steps_at(now)
        start = math.ceil(s - 1e-9)
        req.finish_step = float(start + req.gen_tokens - 1)
        grp.anchor_s, grp.anchor_steps = now, s
        heapq.heappush(grp.members, (req.finish_step, req.request_id, req))
        eng = self.engines[req.de_engine]
        eng.num_decoding += 1
        eng.ctx_tokens += req.prompt_tokens + req.gen_tokens / 2.0
        if eng.num_decoding == 1:
            self._set_forward_load([req.de_engine], True)
        self._reschedule_decode(grp, req.de_engine)
        req.second_token_at = now + (start - s + 1.0) * grp.step_s

    def _reschedule_decode(self, grp: DecodeGroup, changed: int = -1) -> None:
        """New step time after engine `changed` gained or lost a member (synchronized group:
        the slowest engine sets the pace), and the next completion event."""
        if changed >= 0:
            cl = self.cluster
            eng = self.engines[changed]
            eng.decode_step_s = (
                0.0 if not eng.num_decoding
                else costmod.decode_step_time_s(cl.model, cl.hw, eng.num_decoding,
                                                eng.ctx_tokens, cl.coeffs,
                                                num_expert_parallel_engines=cl.decode_ep_engines)
                if cl.step_costs is None
                else cl.step_costs.decode_step_time_s(eng.num_decoding, eng.ctx_tokens)
            )
        engines = self.engines
        step = max([engines[e].decode_step_s for e in grp.engines])
        grp.step_s = step
        if grp.handle:
            self.loop.cancel(grp.handle)
            grp.handle = 0
        if not grp.members:
            return
        first = grp.members[0][0]
        at = grp.anchor_s + (first - grp.anchor_steps) * step
        grp.handle = self.loop.at(at, lambda: self._decode_event(grp))

    def _decode_event(self, grp: DecodeGroup) -> None:
        """The group's earliest members have generated their last token: they leave."""
        grp.handle = 0
        s = grp.steps_at(self.loop.now_s)
        grp.anchor_s, grp.anchor_steps = self.loop.now_s, s
        done: list[Req] = []
        while grp.members and grp.members[0][0] <= s + 1e-6:
            done.append(heapq.heappop(grp.members)[2])
        for req in done:
            eng = self.engines[req.de_engine]
            eng.num_decoding -= 1
            eng.ctx_tokens -= req.prompt_tokens + req.gen_tokens / 2.0
            if eng.num_decoding == 0:
                eng.ctx_tokens = 0.0
                self._set_forward_load([req.de_engine], False)
        for e in {r.de_engine for r in done}:
            self._reschedule_decode(grp, e)
        if not done:
            self._reschedule_decode(grp)
        for req in done:
            self._finish(req)

    def _release_de_slot(self, req: Req, charge: int, is_deferred: bool) -> None:
        """The turn's DE gives back its seat under the sequence cap, its HBM and its load
        charge; deferred (`SimParams.decode_slot_hold_s`), the DEs fetch again at once."""
        eng = self.engines[req.de_engine]
        eng.free_hbm_bytes += req.hbm_bytes
        eng.num_seqs -= 1
        eng.num_tokens -= charge
        self._touch(req.de_engine)
        gi = self.cluster.dgroup_index[req.de_engine]
        self.dgroup_tok[gi] -= charge
        self.de_dirty.add(gi)
        if is_deferred:
            self._dispatch_de()

    def _finish(self, req: Req) -> None:
        """The turn is done: its DE frees HBM and persists the new Full Blocks, and the
        agent's next turn (if any) arrives."""
        now = self.loop.now_s
        req.done_at = now
        eng = self.engines[req.de_engine]
        if self.decode_cap:
            eng.num_admitted -= 1
            self._admit(eng)
        charge = self.policy.de_charge(self.waiting.pop(req.request_id))
        release_at = req.de_assigned_at + self.params.decode_slot_hold_s
        if release_at > now:
            # `SimParams.decode_slot_hold_s`: the seat, HBM and load stay until then.
            self.loop.at(release_at, lambda: self._release_de_slot(req, charge, True))
        else:
            self._release_de_slot(req, charge, False)
        if self.progress is not None:
            self.progress(1)
        if not self.is_oracle:
            block = self.cluster.block
            new_blocks = ((req.prompt_tokens + req.gen_tokens) // block
                          - req.hit_tokens // block)
            if new_blocks > 0:
                if self.params.is_next_turn_after_persist:
                    self._after_persist(req, eng)
                self._persist(eng, new_blocks * block * self.kv_bpt)
                if self.params.is_next_turn_after_persist:
                    return
        lo_hi = self.agent_rows[req.agent]
        nxt = self.agent_next[req.agent]
        if nxt < lo_hi[1]:
            self.agent_next[req.agent] = nxt + 1
            if self.params.turn_return_s > 0.0:
                self._next_turn(req.agent, nxt)
                self._dispatch_de()  # as at a last turn, until it arrives
            else:
                self.arrive(req.agent, nxt)
        else:
            self._dispatch_de()
