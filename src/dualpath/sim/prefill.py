"""Prefill steps in the simulator's event handlers: a prefill group runs one synchronized step at a
time (the slowest engine's attention plus the shared FFN), with its KV streaming overlapped
(layerwise) or before and after it (Basic); a finished prompt goes to its DE (`Handlers`).
"""

from __future__ import annotations

from dualpath.sched import cost as costmod
from dualpath.sim.flows import Flow, Link
from dualpath.sim.reads import Reads
from dualpath.sim.state import Engine, PrefillGroup, Req, StepPart


class Prefill(Reads):
    """The prefill-step handlers (`sim.handlers` gives the whole flow)."""

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

    # -- defined higher up the chain, declared for the calls above ----------
    def _admit(self, de: Engine) -> None:
        """Admit prefilled turns to decode under the cap (`Handlers._admit`)."""
        raise NotImplementedError

    def _enter_decode(self, req: Req, de: Engine) -> None:
        """The turn goes on to decode (`Handlers._enter_decode`)."""
        raise NotImplementedError

