"""The cluster simulator: drives `dualpath.sched` policies over a workload and charges every hop
of both KV paths to the links that carry it (paper Fig. 4 and §4.2).

Hops and the links they load (bytes per request; `H` hit KV, `X` miss KV of a chunk; the PE side
reads `H_p`, the DE side `H_d`, `H = H_p + H_d`):

    storage read     SNIC read + DRAM of the reading node (+ storage-cluster cap)   H_p | H_d
    PE path in       PE DRAM, PE CNIC read (3), PE CNIC write (4)                    H_p
    PE path out      PE CNIC read (5), DE CNIC write (7), DE DRAM                    H_p
    DE path in       DE DRAM, DE CNIC read (3), PE CNIC write (5)                    H_d
    miss KV out      PE CNIC read, DE CNIC write, DE DRAM                            X
    DE copy-in       DE DRAM, DE CNIC read (8|6), DE CNIC write (9|7)                H + X
    persistence      DE CNIC read + write (D2H), DE DRAM x2, SNIC write              new blocks

Forward passes: a PE group (one node when engines are expert-parallel, else one engine) runs
one step at a time; a step's length is the slowest engine's attention plus the shared FFN, and
with layerwise prefill the step's KV streaming is one flow overlapped with compute in closed
form (the step ends when both are done). Without it, the hit KV is loaded before compute and
the KV goes out after it. Decode groups run continuous batching in epochs between membership
changes: within an epoch the step time is constant, so completions are computed, not stepped.
"""

from __future__ import annotations

import bisect
import gc
import heapq
import math
import random
from collections.abc import Callable
from dataclasses import replace
from enum import Enum

from dualpath.core.cluster import ClusterSpec
from dualpath.core.errors import SpecError
from dualpath.core.storage import storage_read_model
from dualpath.sched import cost as costmod
from dualpath.sched.scheduler import Stage
from dualpath.sched.types import EngineReport, ReadPlan, Role, WaitingRequest
from dualpath.sim.config import SimConfig
from dualpath.sim.flows import Flow, FlowNet, Link
from dualpath.sim.kernel import EventLoop
from dualpath.sim.policy import Policy
from dualpath.sim.result import SimResult, build_result
from dualpath.sim.state import Engine, Node, Req

ProgressFn = Callable[[int], None]


class StepPart(Enum):
    """A part of a prefill step that ends on its own event; the step ends when none is left."""

    COMPUTE = 1
    """The forward pass (a timer)."""
    KV_FLOW = 2
    """Layerwise prefill: the step's KV streaming in and out (one flow)."""


class _PrefillGroup:
    __slots__ = ("compute_pending", "engines", "idx", "is_busy", "kv_flow_pending", "outbound",
                 "step")

    def __init__(self, idx: int, engines: list[int]) -> None:
        self.idx = idx
        self.engines = engines
        self.is_busy = False
        self.compute_pending = False
        self.kv_flow_pending = False
        self.step: list[tuple[Req, int]] = []
        self.outbound: dict[Link, float] | None = None


class _DecodeGroup:
    __slots__ = ("anchor_s", "anchor_steps", "engines", "handle", "members", "step_s")

    def __init__(self, engines: list[int]) -> None:
        self.engines = engines
        self.members: list[tuple[float, int, Req]] = []
        """Heap of (finish step, request id, request): members leave only by finishing."""
        self.step_s = 0.0
        self.anchor_s = 0.0
        self.anchor_steps = 0.0
        self.handle = 0


class Simulator:
    """One run. Build with a `SimConfig`, call `run()` once; not reusable."""

    def __init__(self, config: SimConfig, progress: ProgressFn | None = None) -> None:
        self.config = config
        cl: ClusterSpec = config.cluster
        self.model, self.hw = cl.model, cl.hardware
        self.mode = config.mode
        # The mode's switches, read on every step (`Mode.is_oracle` is a property).
        self.is_oracle = config.mode.is_oracle
        self.is_layerwise = config.mode.is_layerwise
        self.is_hbm_gated = not self.is_layerwise and not self.is_oracle
        """Without layerwise prefill a PE-side read lands in the PE's HBM (`_next_read`)."""
        self.params = config.params
        self.progress = progress
        self.loop = EventLoop()
        self.net = FlowNet(self.loop)
        self.rng = random.Random(config.seed)
        coeffs = costmod.coefficients_for(self.model, self.hw)
        if config.cost_overrides:
            coeffs = replace(coeffs, **dict(config.cost_overrides))  # type: ignore[arg-type]
        self.coeffs = coeffs
        self.hbm_reserve = (coeffs.hbm_reserve_fraction if self.params.hbm_reserve_fraction is None
                            else self.params.hbm_reserve_fraction)
        self.attn_fixed_s = costmod.attention_fixed_time_s(self.model, coeffs)
        self._reports: dict[int, EngineReport] = {}
        self.kv_bpt = self.model.kv_bytes_per_token
        self.block = self.params.block_size_tokens
        g = self.hw.gpus_per_node
        self.is_sync = (
            self.model.is_moe if self.params.is_group_synchronized is None
            else self.params.is_group_synchronized
        )
        self.links: list[Link] = []
        bin_s = self.params.utilization_bin_s
        # KV reads run at the storage system's calibrated rate; writes at the line rate.
        storage = self.params.storage_read or storage_read_model(self.hw.name)
        snic_read_bytes_per_s = storage.read_bytes_per_s(
            self.hw.storage_nic_bytes_per_s, self.kv_bpt * self.block)
        cnic = min(self.hw.compute_nic_bytes_per_s, self.hw.pcie_bytes_per_s)
        self.cnic_bytes_per_s = cnic
        self.storage_link = (
            self._link("storage", "storage", -1, self.params.storage_cluster_bytes_per_s, bin_s)
            if self.params.storage_cluster_bytes_per_s > 0 else None
        )
        # MoE weights are sharded over every engine of a role (EP across that role's nodes,
        # as DeepSeek-V3.2 needs: 671 GB of FP8 weights do not fit one node's 8 x 80 GB);
        # dense weights are replicated per engine.
        def kv_room(num_engines: int) -> float:
            return costmod.kv_room_bytes(self.model, self.hw, self.hbm_reserve, num_engines)

        def ep_group(size: int, side: int) -> int:  # 0, or more than the side: the whole side
            return min(size or side, side)

        sp = self.params
        self.pe_hbm_kv_bytes = kv_room(ep_group(sp.prefill_ep_engines, cl.num_prefill_engines))
        # Decode steps read each engine's shard of those same weights.
        self.decode_ep_engines = ep_group(sp.decode_ep_engines, cl.num_decode_engines)
        de_hbm_kv = kv_room(self.decode_ep_engines)
        self.nodes: list[Node] = []
        self.engines: list[Engine] = []
        for n in range(cl.num_nodes):
            is_pf = n < cl.num_prefill_nodes
            node = Node(
                n, is_pf, list(range(n * g, n * g + g)),
                self._link(f"n{n}.snic_read", "snic_read", n, snic_read_bytes_per_s, bin_s),
                self._link(f"n{n}.snic_write", "snic_write", n, self.hw.storage_nic_bytes_per_s,
                           bin_s),
                self._link(f"n{n}.dram", "pe_dram" if is_pf else "de_dram", n,
                           self.hw.dram_bytes_per_s, bin_s),
                float(self.hw.dram_buffer_bytes),
            )
            self.nodes.append(node)
            side = "pe" if is_pf else "de"
            for e in node.engines:
                self.engines.append(Engine(
                    e, n,
                    self._link(f"e{e}.cnic_read", f"{side}_cnic_read", n, cnic, bin_s),
                    self._link(f"e{e}.cnic_write", f"{side}_cnic_write", n, cnic, bin_s),
                    self.pe_hbm_kv_bytes if is_pf else de_hbm_kv,
                ))
        pe_nodes = range(cl.num_prefill_nodes)
        de_nodes = range(cl.num_prefill_nodes, cl.num_nodes)
        if self.is_sync:
            self.pgroups = [_PrefillGroup(i, self.nodes[n].engines) for i, n in enumerate(pe_nodes)]
            self.dgroups = [_DecodeGroup(self.nodes[n].engines) for n in de_nodes]
        else:
            pe_engines = [e for n in pe_nodes for e in self.nodes[n].engines]
            de_engines = [e for n in de_nodes for e in self.nodes[n].engines]
            self.pgroups = [_PrefillGroup(i, [e]) for i, e in enumerate(pe_engines)]
            self.dgroups = [_DecodeGroup([e]) for e in de_engines]
        self.pgroup_of = {e: grp for grp in self.pgroups for e in grp.engines}
        self.dgroup_of = {e: grp for grp in self.dgroups for e in grp.engines}
        self.dgroup_index = {e: gi for gi, grp in enumerate(self.dgroups) for e in grp.engines}
        self.policy = Policy(config, coeffs, len(self.dgroups))
        self.sched = self.policy.sched
        self.dgroup_tok = [0] * len(self.dgroups)
        """Sum of `tok` over each DE group's engines (DE phase 1 balances it)."""
        self.de_dirty: set[int] = set()
        self.reqs: list[Req] = []
        self.waiting: dict[int, WaitingRequest] = {}
        self.next_pgroup = 0
        self.de_read_q: dict[int, int] = dict.fromkeys(de_nodes, 0)
        """node -> read queue (tokens) of every DE node, kept equal to `Node.read_q_tokens`.
        A PE fetch reads it for the DE nodes of the requests it assigns; giving it every DE node
        (not only those of queued requests) changes no decision and copies in O(DE nodes)."""
        self.num_done = 0
        self.is_stopped = False
        self.stop_reason = ""
        self.attn_ratio_sum = 0.0
        self.attn_ratio_steps = 0
        self.attn_ratio_first: list[float] = []
        self.num_prefill_steps = 0
        self.ttft_at: list[float] = []
        """Completion times of prefills, non-decreasing, with running TTFT sums (stop rule)."""
        self.ttft_sum: list[float] = [0.0]
        wl = config.workload
        self.wl_prompt = wl.prompt_tokens.tolist()
        self.wl_hit = wl.hit_tokens.tolist()
        self.wl_gen = wl.gen_tokens.tolist()
        self.wl_starts = wl.starts.tolist()
        self._check_requests_fit(de_hbm_kv)
        self.agent_rows: list[tuple[int, int]] = []
        self.agent_next: list[int] = []

    def _check_requests_fit(self, de_hbm_kv_bytes: float) -> None:
        """Refuse a workload whose largest turn can never be placed on a decode engine (its
        HBM reservation exceeds what an empty engine has for KV): it would wait forever."""
        if not self.wl_prompt:
            return
        row = max(range(len(self.wl_prompt)), key=lambda i: self.wl_prompt[i] + self.wl_gen[i])
        need = self.policy.params.hbm_bytes(
            WaitingRequest(0, self.wl_prompt[row], self.wl_hit[row], self.wl_gen[row])
        )
        if need > de_hbm_kv_bytes:
            raise SpecError(
                "sim", "workload", f"turn of {self.wl_prompt[row]}+{self.wl_gen[row]} tokens",
                f"needs {need / 1e9:.1f} GB of decode-engine HBM for KV but an engine has "
                f"{de_hbm_kv_bytes / 1e9:.1f} GB (HBM x {1 - self.hbm_reserve:g} "
                "minus its weight share); use a shorter --mal, more HBM, smaller KV/weights or a "
                "larger expert-parallel group (--decode-ep-engines)",
            )

    def _link(self, name: str, kind: str, node: int, cap: float, bin_s: float) -> Link:
        link = Link(name, kind, node, cap, bin_s)
        self.links.append(link)
        return link

    # -- drivers ----------------------------------------------------------------------------
    def run(self) -> SimResult:
        """Run to completion (or the online stop rule) and summarize."""
        drv = self.config.driver
        wl = self.config.workload
        if drv.kind == "offline":
            for k in range(drv.num_agents):
                self._new_agent(k % wl.num_agents)
        elif drv.kind == "online":
            self._schedule_online_arrival(0)
            self.loop.after(drv.steady_window_s, self._check_steady)
        else:
            assert wl.arrival_s is not None
            times = wl.arrival_s.tolist()
            for k in range(wl.num_agents):
                lo, hi = self.wl_starts[k], self.wl_starts[k + 1]
                self.agent_rows.append((lo, hi))
                self.agent_next.append(hi)  # replay: one request per row, no follow-ups
                for row in range(lo, hi):
                    self.loop.at(times[row], self._arrival_cb(k, row))
        until = drv.max_duration_s if drv.kind == "online" else math.inf
        # Only the online driver ever stops early: other runs skip the per-event check.
        self.loop.run(until_s=until, should_stop=(lambda: self.is_stopped)
                      if drv.kind == "online" else None)
        if drv.kind == "online" and not self.stop_reason:
            self.stop_reason = "max_duration"
        return build_result(self)

    def _arrival_cb(self, agent: int, row: int) -> Callable[[], None]:
        return lambda: self._arrive(agent, row)

    def _new_agent(self, source: int) -> None:
        agent = len(self.agent_rows)
        lo, hi = self.wl_starts[source], self.wl_starts[source + 1]
        self.agent_rows.append((lo, hi))
        self.agent_next.append(lo + 1)
        self._arrive(agent, lo)

    def _schedule_online_arrival(self, k: int) -> None:
        drv = self.config.driver
        if drv.num_agents and k >= drv.num_agents:
            return
        gap = self.rng.expovariate(drv.agents_per_s)

        def arrive() -> None:
            self._new_agent(k % self.config.workload.num_agents)
            self._schedule_online_arrival(k + 1)

        self.loop.after(gap, arrive)

    def _check_steady(self) -> None:
        drv = self.config.driver
        now = self.loop.now_s
        if now >= drv.steady_lookback_s + drv.steady_window_s:
            cur = self._mean_ttft(now - drv.steady_window_s, now)
            old = self._mean_ttft(now - drv.steady_lookback_s - drv.steady_window_s,
                                  now - drv.steady_lookback_s)
            if cur > 0 and old > 0 and abs(cur - old) <= drv.steady_tolerance * old:
                self.stop_reason = "steady_state"
                self.is_stopped = True
                return
        self.loop.after(drv.steady_window_s / 5, self._check_steady)

    def _mean_ttft(self, lo_s: float, hi_s: float) -> float:
        """Mean TTFT of the prefills that completed in [lo_s, hi_s)."""
        lo = bisect.bisect_left(self.ttft_at, lo_s)
        hi = bisect.bisect_left(self.ttft_at, hi_s)
        return (self.ttft_sum[hi] - self.ttft_sum[lo]) / (hi - lo) if hi > lo else 0.0

    # -- arrival and inter-engine scheduling ---------------------------------------------------
    def _arrive(self, agent: int, row: int) -> None:
        req = Req(len(self.reqs), agent, row, self.wl_prompt[row], self.wl_hit[row],
                  self.wl_gen[row], self.loop.now_s)
        self.reqs.append(req)
        w = WaitingRequest(req.request_id, req.prompt_tokens, req.hit_tokens, req.gen_tokens)
        self.waiting[req.request_id] = w
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
            old = cache.get(idx)
            read_q = nodes[e.node].read_q_tokens
            if old is None or old.read_q_tokens != read_q:
                old = EngineReport(idx, e.node, role, e.num_seqs, e.num_tokens, read_q,
                                   int(e.free_hbm_bytes))
                cache[idx] = old
            out.append(old)
        return out

    def _touch(self, engine_id: int) -> None:
        """Drop the cached report of an engine whose counters just changed."""
        self._reports.pop(engine_id, None)

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
        for gi in dirty:
            head = sched.de_head(gi)
            if head is None:
                continue
            grp = self.dgroups[gi]
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
        num = len(self.pgroups)
        beta = sched.params.beta_tokens
        moved = False
        for k in range(num):
            if not sched.num_pe_waiting:
                break
            grp = self.pgroups[(self.next_pgroup + k) % num]
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
        """FIFO server: one read at a time at the storage NIC's (calibrated) read rate; a read
        starts only when the node buffer has room for it (or the buffer is empty). Without
        layerwise prefill a PE-side read lands in its engine's HBM, so it also waits for room
        there (`_first_hbm_fit`); reads of engines with room go first meanwhile."""
        if nd.is_reading or not nd.read_fifo:
            return
        pick = self._first_hbm_fit(nd) if self.is_hbm_gated and nd.is_prefill else 0
        if pick < 0:
            return  # retried when a request of this node leaves its PE's HBM
        req, tokens = nd.read_fifo[pick]
        nbytes = tokens * self.kv_bpt
        if nd.buffer_used_bytes > 0 and nd.buffer_used_bytes + nbytes > nd.buffer_bytes:
            return  # retried when the buffer frees
        if pick == 0:
            nd.read_fifo.popleft()
        else:
            del nd.read_fifo[pick]
        if self.is_hbm_gated and nd.is_prefill:
            pe = self.engines[req.pe_engine]
            req.pe_held_bytes = req.prompt_tokens * self.kv_bpt
            pe.held_kv_bytes += req.pe_held_bytes
            pe.peak_held_kv_bytes = max(pe.peak_held_kv_bytes, pe.held_kv_bytes)
        nd.is_reading = True
        nd.take_buffer(nbytes)
        links: list[tuple[Link, float]] = [(nd.snic_read, 1.0), (nd.dram, 1.0)]
        if self.storage_link is not None:
            links.append((self.storage_link, 1.0))

        def done() -> None:
            nd.is_reading = False
            nd.read_q_tokens -= tokens
            if not nd.is_prefill:
                self.de_read_q[nd.idx] = nd.read_q_tokens
            nd.read_tokens_total += tokens
            req.num_reads_left -= 1
            if req.num_reads_left == 0:
                self._read_done(req)
            self._next_read(nd)

        self.net.start(Flow(links, nbytes, done))

    def _first_hbm_fit(self, nd: Node) -> int:
        """Index of the first queued read whose PE has HBM room for the request's whole KV
        (or holds none), -1 if none has; the walk stops once every engine of the node is
        known to be full."""
        room, kv, engines = self.pe_hbm_kv_bytes, self.kv_bpt, self.engines
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
        if nd.read_fifo and not nd.is_reading:
            self._next_read(nd)

    def _read_done(self, req: Req) -> None:
        req.read_done_at = self.loop.now_s
        self.engines[req.pe_engine].ready.append(req)
        self._try_prefill(self.pgroup_of[req.pe_engine])

    # -- prefill ----------------------------------------------------------------------------------
    def _try_prefill(self, grp: _PrefillGroup) -> None:
        if grp.is_busy:
            return
        model, hw, coeffs = self.model, self.hw, self.coeffs
        step: list[tuple[Req, int]] = []
        attn: list[float] = []
        total_new = 0
        for e in grp.engines:
            eng = self.engines[e]
            if not eng.ready:
                attn.append(self.attn_fixed_s)  # an idle engine still joins the synchronized step
                continue
            pairs = []
            for req, n in self.policy.pack(eng.ready, self.pe_hbm_kv_bytes,
                                           self.is_layerwise):
                step.append((req, n))
                pairs.append((req.cached_tokens, n))
                total_new += n
            attn.append(costmod.prefill_attention_time_s(model, hw, pairs, coeffs))
        if not step:
            return
        grp.is_busy = True
        grp.step = step
        now = self.loop.now_s
        for req, _ in step:
            if req.prefill_started_at < 0:
                req.prefill_started_at = now
        if self.is_sync:
            per_engine = total_new / len(grp.engines)
            compute_s = max(attn) + costmod.prefill_ffn_time_s(model, hw, per_engine, coeffs)
            mean = sum(attn) / len(attn)
            ratio = max(attn) / mean if mean > 0 else 1.0
            self.attn_ratio_sum += ratio
            self.attn_ratio_steps += 1
            self.attn_ratio_first.append(ratio)
        else:
            compute_s = attn[0] + costmod.prefill_ffn_time_s(model, hw, total_new, coeffs)
        compute_s += coeffs.per_step_overhead_s
        self.num_prefill_steps += 1
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
        f = self.params.inference_load_fraction
        if f <= 0.0:
            return
        share = max(self.params.kv_min_share, 1.0 - f) if is_busy else 1.0
        cap = self.cnic_bytes_per_s * share
        for e in engines:
            eng = self.engines[e]
            self.net.set_capacity(eng.cnic_read, cap)
            self.net.set_capacity(eng.cnic_write, cap)

    def _step_part_done(self, grp: _PrefillGroup, part: StepPart) -> None:
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
        """The prompt KV is in the DE buffer and the first token exists: copy in, decode."""
        req.prefill_done_at = self.loop.now_s
        self.ttft_at.append(req.prefill_done_at)
        self.ttft_sum.append(self.ttft_sum[-1] + req.prefill_done_at - req.arrived_at)
        drv = self.config.driver
        if (drv.kind == "online" and drv.ttft_limit_s > 0
                and req.prefill_done_at - req.arrived_at > drv.ttft_limit_s):
            self.stop_reason = "ttft_limit"
            self.is_stopped = True
        de = self.engines[req.de_engine]
        if self.is_oracle:
            self._join_decode(req)
            return
        de.copy_fifo.append(req)
        self._next_copy(de)

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

    def _persist(self, de: Engine, nbytes: float) -> None:
        """New Full Blocks go GPU -> DE buffer (D2H through the CNIC) -> storage NIC. One
        transfer per DE at a time; blocks finished meanwhile go together in the next one."""
        de.persist_pending_bytes += nbytes
        if de.is_persisting:
            return
        total, de.persist_pending_bytes = de.persist_pending_bytes, 0.0
        de.is_persisting = True
        nd = self.nodes[de.node]

        def persisted() -> None:
            de.is_persisting = False
            if de.persist_pending_bytes > 0:
                self._persist(de, 0.0)

        self.net.start(Flow(
            [(de.cnic_read, 1.0), (de.cnic_write, 1.0), (nd.dram, 2.0), (nd.snic_write, 1.0)],
            total, persisted))

    # -- decode ------------------------------------------------------------------------------------
    def _steps_now(self, grp: _DecodeGroup) -> float:
        if grp.step_s <= 0:
            return grp.anchor_steps
        return grp.anchor_steps + (self.loop.now_s - grp.anchor_s) / grp.step_s

    def _join_decode(self, req: Req) -> None:
        now = self.loop.now_s
        req.decode_joined_at = now
        if req.gen_tokens <= 1:
            self._finish(req)
            return
        grp = self.dgroup_of[req.de_engine]
        s = self._steps_now(grp)
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

    def _reschedule_decode(self, grp: _DecodeGroup, changed: int = -1) -> None:
        """New step time after engine `changed` gained or lost a member (synchronized group:
        the slowest engine sets the pace), and the next completion event."""
        if changed >= 0:
            eng = self.engines[changed]
            eng.decode_step_s = (
                costmod.decode_step_time_s(self.model, self.hw, eng.num_decoding,
                                           eng.ctx_tokens, self.coeffs,
                                           num_expert_parallel_engines=self.decode_ep_engines)
                if eng.num_decoding else 0.0
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

    def _decode_event(self, grp: _DecodeGroup) -> None:
        grp.handle = 0
        s = self._steps_now(grp)
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

    def _finish(self, req: Req) -> None:
        now = self.loop.now_s
        req.done_at = now
        eng = self.engines[req.de_engine]
        eng.free_hbm_bytes += req.hbm_bytes
        eng.num_seqs -= 1
        charge = self.policy.de_charge(self.waiting.pop(req.request_id))
        eng.num_tokens -= charge
        self._touch(req.de_engine)
        gi = self.dgroup_index[req.de_engine]
        self.dgroup_tok[gi] -= charge
        self.de_dirty.add(gi)
        self.num_done += 1
        if self.progress is not None:
            self.progress(1)
        if not self.is_oracle:
            new_blocks = ((req.prompt_tokens + req.gen_tokens) // self.block
                          - req.hit_tokens // self.block)
            if new_blocks > 0:
                self._persist(eng, new_blocks * self.block * self.kv_bpt)
        lo_hi = self.agent_rows[req.agent]
        nxt = self.agent_next[req.agent]
        if nxt < lo_hi[1]:
            self.agent_next[req.agent] = nxt + 1
            self._arrive(req.agent, nxt)
        else:
            self._dispatch_de()


def simulate(config: SimConfig, progress: ProgressFn | None = None) -> SimResult:
    """Run one simulation. `progress(n)` is called as turns complete (for a progress bar).

    The cyclic garbage collector is paused for the run: requests, flows and events are freed
    by reference counting, while each of the collector's full passes walks every live object,
    which at the paper's largest scale (millions of requests) is a large share of the run
    (perf). Whatever cycles a run leaves are collected after it. Results do not depend on it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return Simulator(config, progress).run()
    finally:
        if was_enabled:
            gc.enable()
