"""Mutable run-time state of the simulated cluster: requests, nodes, engines, links.

Block-state invariant (ARCHITECTURE.md), as the simulator tracks it per request: the hit blocks
are persisted only, then being read into one node buffer (or two, for a split read), then in that
buffer until the forward pass that streams them completes; the prompt KV is then in the DE buffer
until its copy-in completes, then in DE HBM until the turn finishes, when its new Full Blocks are
being persisted. A buffer is released only after its successor holds the blocks.
"""

from __future__ import annotations

from collections import deque

from dualpath.sim.flows import Link

INF = float("inf")


class Req:
    """One turn in flight. Times are `nan`-free floats; -1.0 means "not yet"."""

    __slots__ = (
        "agent",
        "attn_s",
        "computed_tokens",
        "de",
        "de_read_tokens",
        "finish_step",
        "gen",
        "hbm_bytes",
        "hit",
        "pe",
        "pe_held_bytes",
        "pe_read_tokens",
        "prompt",
        "reads_left",
        "rid",
        "row",
        "t_arrive",
        "t_de",
        "t_done",
        "t_join",
        "t_pe",
        "t_prefill_done",
        "t_prefill_start",
        "t_read_done",
        "t_second",
    )

    def __init__(self, rid: int, agent: int, row: int, prompt: int, hit: int, gen: int,
                 now_s: float) -> None:
        self.rid = rid
        self.agent = agent
        self.row = row
        self.prompt = prompt
        self.hit = hit
        self.gen = gen
        self.pe = -1
        self.de = -1
        self.pe_read_tokens = 0
        self.de_read_tokens = 0
        self.reads_left = 0
        self.hbm_bytes = 0
        self.pe_held_bytes = 0.0
        """PE HBM this request holds from its read's start (no layerwise prefill)."""
        self.computed_tokens = 0
        """Prompt tokens whose KV the PE has computed so far (chunked prefill)."""
        self.finish_step = 0.0
        self.attn_s = 0.0
        self.t_arrive = now_s
        self.t_de = -1.0
        self.t_pe = -1.0
        self.t_read_done = -1.0
        self.t_prefill_start = -1.0
        self.t_prefill_done = -1.0
        self.t_join = -1.0
        self.t_second = -1.0
        self.t_done = -1.0

    @property
    def cached_tokens(self) -> int:
        """Tokens whose KV is available to the next chunk: hits plus computed chunks."""
        return self.hit + self.computed_tokens

    @property
    def remaining_tokens(self) -> int:
        return self.prompt - self.hit - self.computed_tokens


class Node:
    """One node: its storage NIC (a FIFO read server plus a write direction), DRAM, buffer."""

    __slots__ = (
        "buffer_bytes",
        "buffer_peak_bytes",
        "buffer_used_bytes",
        "dram",
        "engines",
        "idx",
        "is_prefill",
        "is_reading",
        "read_fifo",
        "read_q_tokens",
        "read_tokens_total",
        "snic_read",
        "snic_write",
    )

    def __init__(self, idx: int, is_prefill: bool, engines: list[int], snic_read: Link,
                 snic_write: Link, dram: Link, buffer_bytes: float) -> None:
        self.idx = idx
        self.is_prefill = is_prefill
        self.engines = engines
        self.snic_read = snic_read
        self.snic_write = snic_write
        self.dram = dram
        self.buffer_bytes = buffer_bytes
        self.buffer_used_bytes = 0.0
        self.buffer_peak_bytes = 0.0
        self.read_fifo: deque[tuple[Req, int]] = deque()
        self.read_q_tokens = 0
        """Tokens queued or being read on this node's storage NIC (the scheduler's read_q)."""
        self.read_tokens_total = 0
        self.is_reading = False

    def take_buffer(self, nbytes: float) -> None:
        self.buffer_used_bytes += nbytes
        if self.buffer_used_bytes > self.buffer_peak_bytes:
            self.buffer_peak_bytes = self.buffer_used_bytes


class Engine:
    """One GPU: its compute NIC (two directions, PCIe-side), scheduler counters, queues."""

    __slots__ = (
        "cnic_read",
        "cnic_write",
        "copy_fifo",
        "ctx_tokens",
        "decode_step_s",
        "free_hbm_bytes",
        "held_kv_bytes",
        "idx",
        "is_copying",
        "is_persisting",
        "node",
        "num_decoding",
        "num_seqs",
        "num_tokens",
        "peak_held_kv_bytes",
        "persist_pending_bytes",
        "ready",
    )

    def __init__(self, idx: int, node: int, cnic_read: Link, cnic_write: Link,
                 free_hbm_bytes: float) -> None:
        self.idx = idx
        self.node = node
        self.cnic_read = cnic_read
        """NIC reading host or GPU memory (PCIe upstream of the NIC): paper's "CNIC read"."""
        self.cnic_write = cnic_write
        """NIC writing host or GPU memory: paper's "CNIC write"."""
        self.num_seqs = 0
        self.num_tokens = 0
        self.free_hbm_bytes = free_hbm_bytes
        self.held_kv_bytes = 0.0
        """PE without layerwise prefill: HBM its requests hold from read start until their KV
        has left for the DE (the whole prompt's KV each)."""
        self.peak_held_kv_bytes = 0.0
        self.ready: deque[Req] = deque()
        """PE: requests whose hit KV is in a buffer, FIFO, waiting for (more) prefill."""
        self.num_decoding = 0
        self.ctx_tokens = 0.0
        """DE: sum of the decoding requests' mean contexts (what a decode step reads)."""
        self.copy_fifo: deque[Req] = deque()
        """DE: prompts whose KV is complete in the DE buffer, waiting for copy-in (FIFO)."""
        self.is_copying = False
        self.persist_pending_bytes = 0.0
        """DE: bytes of new Full Blocks waiting for the next persistence transfer."""
        self.is_persisting = False
        self.decode_step_s = 0.0
        """DE: the cost model's step time for the current decode batch (cached)."""
