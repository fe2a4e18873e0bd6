"""Storage reads in the simulator's event handlers: each node's read server moves a request's
hit KV from storage into the node buffer (and, without layerwise prefill, a PE-side read into
its engine's HBM); a request whose reads are done is ready for its prefill group (`Prefill`).
"""

from __future__ import annotations

import math

from dualpath.sched.types import ReadPlan
from dualpath.sim.dispatch import Dispatch
from dualpath.sim.flows import Flow, Link
from dualpath.sim.state import Node, PrefillGroup, Req


class Reads(Dispatch):
    """The storage-read handlers (`sim.handlers` gives the whole flow)."""

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

    # -- defined higher up the chain, declared for the calls above ----------
    def _try_prefill(self, grp: PrefillGroup) -> None:
        """Start the group's next step if it may (`Prefill._try_prefill`)."""
        raise NotImplementedError

