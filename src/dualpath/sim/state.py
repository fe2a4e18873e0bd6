"""Mutable run-time state of the simulated cluster: requests, nodes, engines, engine groups,
the prefill-completion log.

Block-state invariant (ARCHITECTURE.md), as the simulator tracks it per request: the hit blocks
are persisted only, then being read into one node buffer (or two, for a split read), then in that
buffer until the forward pass that streams them completes; the prompt KV is then in the DE buffer
until its copy-in completes, then in DE HBM until the turn finishes, when its new Full Blocks are
being persisted. A buffer is released only after its successor holds the blocks.
"""

from __future__ import annotations

import bisect
from collections import deque
from enum import Enum

from dualpath.sim.flows import Link

INF = float("inf")


class Req:
    """One turn in flight. Field names follow `sched.types.WaitingRequest`; times (`*_at`,
    simulated seconds) are `nan`-free floats, -1.0 meaning "not yet"."""

    __slots__ = (
        "agent",
        "arrived_at",
        "computed_tokens",
        "de_assigned_at",
        "de_engine",
        "de_read_tokens",
        "decode_joined_at",
        "done_at",
        "finish_step",
        "gen_tokens",
        "hbm_bytes",
        "hit_tokens",
        "num_reads_left",
        "pe_assigned_at",
        "pe_engine",
        "pe_held_bytes",
        "pe_read_tokens",
        "prefill_done_at",
        "prefill_started_at",
        "prompt_tokens",
        "read_done_at",
        "request_id",
        "row",
        "second_token_at",
    )

    def __init__(self, request_id: int, agent: int, row: int, prompt_tokens: int,
                 hit_tokens: int, gen_tokens: int, arrived_at: float) -> None:
        self.request_id = request_id
        self.agent = agent
        self.row = row
        """The turn's row in the workload's arrays."""
        self.prompt_tokens = prompt_tokens
        self.hit_tokens = hit_tokens
        self.gen_tokens = gen_tokens
        self.pe_engine = -1
        self.de_engine = -1
        self.pe_read_tokens = 0
        self.de_read_tokens = 0
        """Hit tokens read on the PE's and on the DE's node (both > 0: a split read)."""
        self.num_reads_left = 0
        self.hbm_bytes = 0
        """DE HBM reserved for the turn's KV from its DE assignment to its end."""
        self.pe_held_bytes = 0.0
        """PE HBM this request holds from its read's start (no layerwise prefill)."""
        self.computed_tokens = 0
        """Prompt tokens whose KV the PE has computed so far (chunked prefill)."""
        self.finish_step = 0.0
        """The decode group's step count at which the turn's last token is out."""
        self.arrived_at = arrived_at
        self.de_assigned_at = -1.0
        self.pe_assigned_at = -1.0
        self.read_done_at = -1.0
        self.prefill_started_at = -1.0
        self.prefill_done_at = -1.0
        self.decode_joined_at = -1.0
        self.second_token_at = -1.0
        self.done_at = -1.0

    @property
    def cached_tokens(self) -> int:
        """Tokens whose KV is available to the next chunk: hits plus computed chunks."""
        return self.hit_tokens + self.computed_tokens

    @property
    def remaining_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens - self.computed_tokens


class Node:
    """One node: its storage NIC (a read server plus a write direction), DRAM, buffer.

    The read server starts a queued read while fewer than `read_slots` are in flight (0: no
    bound); reads in flight share the NIC as flows. One slot is the paper's FIFO read queue."""

    __slots__ = (
        "buffer_bytes",
        "buffer_peak_bytes",
        "buffer_used_bytes",
        "dram",
        "engines",
        "idx",
        "is_prefill",
        "num_reading",
        "read_fifo",
        "read_q_tokens",
        "read_slots",
        "read_tokens_total",
        "snic_read",
        "snic_write",
    )

    def __init__(self, idx: int, is_prefill: bool, engines: list[int], snic_read: Link,
                 snic_write: Link, dram: Link, buffer_bytes: float, read_slots: int = 1) -> None:
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
        self.read_slots = read_slots
        self.num_reading = 0
        """Reads in flight on this node's storage NIC."""

    def can_start_read(self) -> bool:
        """Whether the read server has a free slot."""
        return self.read_slots == 0 or self.num_reading < self.read_slots

    def take_buffer(self, nbytes: float) -> None:
        self.buffer_used_bytes += nbytes
        if self.buffer_used_bytes > self.buffer_peak_bytes:
            self.buffer_peak_bytes = self.buffer_used_bytes


class Engine:
    """One GPU: its compute NIC (two directions, PCIe-side), scheduler counters, queues."""

    __slots__ = (
        "admit_fifo",
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
        "num_admitted",
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
        self.admit_fifo: deque[Req] = deque()
        """DE with the cap at decode admission (`SimParams.decode_cap_at`): prefilled turns
        waiting in the DE buffer for a place under the cap (FIFO)."""
        self.num_admitted = 0
        """DE: turns admitted to decode (copy-in or decoding) under that cap."""
        self.is_copying = False
        self.persist_pending_bytes = 0.0
        """DE: bytes of new Full Blocks waiting for the next persistence transfer."""
        self.is_persisting = False
        self.decode_step_s = 0.0
        """DE: the cost model's step time for the current decode batch (cached)."""


class StepPart(Enum):
    """A part of a prefill step that ends on its own event; the step ends when none is left."""

    COMPUTE = 1
    """The forward pass (a timer)."""
    KV_FLOW = 2
    """Layerwise prefill: the step's KV streaming in and out (one flow)."""


class PrefillGroup:
    """Engines that run prefill steps together: a node when its engines are synchronized
    (expert parallel), else one engine. One step at a time."""

    __slots__ = ("compute_pending", "engines", "idx", "is_busy", "kv_flow_pending", "outbound",
                 "started_at", "step")

    def __init__(self, idx: int, engines: list[int]) -> None:
        self.idx = idx
        self.engines = engines
        self.is_busy = False
        self.started_at = 0.0
        """When the running step started."""
        self.compute_pending = False
        self.kv_flow_pending = False
        self.step: list[tuple[Req, int]] = []
        """The running step: (request, new tokens of its chunk)."""
        self.outbound: dict[Link, float] | None = None
        """Without layerwise prefill: bytes the step sends to the DE buffers once computed."""


class DecodeGroup:
    """Engines that decode in lockstep (as `PrefillGroup`), in epochs between membership
    changes: within an epoch the step time is constant, so the step count at time `t` is
    `anchor_steps + (t - anchor_s) / step_s`."""

    __slots__ = ("anchor_s", "anchor_steps", "engines", "handle", "members", "step_s")

    def __init__(self, engines: list[int]) -> None:
        self.engines = engines
        self.members: list[tuple[float, int, Req]] = []
        """Heap of (finish step, request id, request): members leave only by finishing."""
        self.step_s = 0.0
        self.anchor_s = 0.0
        self.anchor_steps = 0.0
        self.handle = 0
        """The event loop handle of the next completion (0: none scheduled)."""

    def steps_at(self, now_s: float) -> float:
        """Decode steps the group has run by `now_s` (a fraction within a step)."""
        if self.step_s <= 0:
            return self.anchor_steps
        return self.anchor_steps + (now_s - self.anchor_s) / self.step_s


class TtftLog:
    """Prefill completions in time order with running TTFT sums (the online stop rules)."""

    __slots__ = ("done_at", "max_ttft_s", "sums")

    def __init__(self) -> None:
        self.done_at: list[float] = []
        """Completion times of prefills, non-decreasing."""
        self.sums: list[float] = [0.0]
        """`sums[i]`: the TTFTs of the first `i` prefills added up."""
        self.max_ttft_s = 0.0

    def add(self, arrived_at: float, done_at: float) -> None:
        self.done_at.append(done_at)
        self.sums.append(self.sums[-1] + done_at - arrived_at)
        if done_at - arrived_at > self.max_ttft_s:
            self.max_ttft_s = done_at - arrived_at

    def mean_ttft_s(self, lo_s: float, hi_s: float) -> float:
        """Mean TTFT of the prefills that completed in [lo_s, hi_s)."""
        lo = bisect.bisect_left(self.done_at, lo_s)
        hi = bisect.bisect_left(self.done_at, hi_s)
        return (self.sums[hi] - self.sums[lo]) / (hi - lo) if hi > lo else 0.0
