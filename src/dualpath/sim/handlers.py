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

from dualpath.sched import cost as costmod
from dualpath.sim.dispatch import ATTN_BIN_S, ProgressFn
from dualpath.sim.flows import Flow
from dualpath.sim.prefill import Prefill
from dualpath.sim.state import DecodeGroup, Engine, Req

__all__ = ["ATTN_BIN_S", "Handlers", "ProgressFn"]


class Handlers(Prefill):
    """The event handlers of one run and the state they share beyond the cluster's: the
    requests, the scheduler's adapter, the per-agent turn cursors and the run's statistics.

    The handlers are one class in four files, each a step of the flow above and each
    building on the one before: `Dispatch` (arrival, inter-engine scheduling; the shared
    state), `Reads` (storage reads), `Prefill` (prefill steps) and this one (admission to
    decode, copy-in, persistence, decode)."""

    # -- admission to decode --------------------------------------------------------------------
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
