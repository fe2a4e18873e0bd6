"""Typed messages between the scheduler and the nodes, and between nodes.

Everything that crosses a process boundary is one of these frozen dataclasses, pickled over a
queue; nothing else is shared. Engines address each other by node id (the inbox to post to) and
engine id; KV bytes never travel in messages, only slot numbers of the buffers the bytes land in
(the bytes go through a transfer engine, `transfer.py`).

Request flow (PE engine p on prefill node A, DE engine d on decode node B):

    driver -> scheduler  Submitted                     a turn to serve (prompt, cache hit)
    scheduler -> A  Fetched(prefill=[PrefillTask])     reply to A's group leader's Fetch
    scheduler -> B  Fetched(decode=[DecodeTask])       reply to B's Fetch
    B -> A          DeBufferReady                      DE buffer slots allocated, DE reads done
    A -> B          PrefillDone                        all prompt KV in B's buffer + first token
    B -> scheduler  TurnTokens                         (streaming requests) each step's new tokens
    driver -> scheduler -> B  Cancel                   (optional) end the request early
    B -> scheduler  TurnDone                           generated tokens, timings, byte counts
    scheduler -> driver  TurnTokens, TurnDone          forwarded (the driver submits the next turn)

The scheduler is its own process (`scheduler_process.serve_scheduler`): nodes send it
everything they address to "the scheduler" (fetches, TurnDone, NodeUp, NodeStats, NodeFailed);
it forwards to the driver what the driver needs and answers the fetches itself.
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass, field
from typing import Any, Protocol

from dualpath.runtime.model.sampling import SamplingParams, TokenLogprobs
from dualpath.runtime.transfer import SegmentInfo
from dualpath.sched.types import WaitingRequest


@dataclass(frozen=True)
class EngineLoad:
    """One engine's fetch report (paper §6.1: `seq_e`, `tok_e`, `read_q`, free memory)."""

    engine_id: int
    num_seqs: int
    num_tokens: int
    read_q_tokens: int
    free_hbm_bytes: int


@dataclass(frozen=True)
class TurnSpec:
    """One turn's prompt as the engines need it, carried whole from the driver to both engines:
    its token ids, the keys of its Full Blocks and its cache hit (the leading stored blocks;
    where each hit block is read is the scheduler's later choice, a task's `num_pe_blocks`)."""

    token_ids: tuple[int, ...]
    block_keys: tuple[bytes, ...]
    """`core.blocks.block_keys` of `token_ids`: one per Full Block of the prompt."""
    num_hit_blocks: int
    """Blocks `[0, num_hit_blocks)` are stored (the driver's lookup, short of the last token)."""


@dataclass(frozen=True)
class Submitted:
    """Driver -> scheduler: a turn to serve; what the engines need besides the policy's view."""

    request: WaitingRequest
    turn: TurnSpec
    sampling: SamplingParams
    """Its seed is set; `max_tokens` is `request.gen_tokens`."""
    is_streaming: bool = False
    """The DE reports each decode step's new tokens (`TurnTokens`) before `TurnDone`."""


@dataclass(frozen=True)
class SchedulerStats:
    """Scheduler -> driver at shutdown."""

    num_fetches: int


@dataclass(frozen=True)
class Fetch:
    """A group leader pulls work for its engines."""

    node: int
    loads: tuple[EngineLoad, ...]


@dataclass(frozen=True)
class PrefillTask:
    """Prefill `turn` on `pe_engine`; blocks `[0, num_pe_blocks)` of its hit are read on this
    (PE) node, blocks `[num_pe_blocks, turn.num_hit_blocks)` are in the DE buffer."""

    request_id: int
    pe_engine: int
    de_node: int
    de_engine: int
    turn: TurnSpec
    num_pe_blocks: int
    sampling: SamplingParams


@dataclass(frozen=True)
class DecodeTask:
    """Decode `turn` on `de_engine` after prefill on `pe_node`; the DE node reads hit blocks
    `[num_pe_blocks, turn.num_hit_blocks)` into its buffer first."""

    request_id: int
    de_engine: int
    pe_node: int
    turn: TurnSpec
    num_pe_blocks: int
    sampling: SamplingParams
    is_streaming: bool = False


@dataclass(frozen=True)
class Fetched:
    """Scheduler's reply to a Fetch."""

    prefill: tuple[PrefillTask, ...] = ()
    decode: tuple[DecodeTask, ...] = ()


@dataclass(frozen=True)
class DeBufferReady:
    """The DE buffer holds one slot per prompt block (slot i <-> block i) and the DE-side hit
    blocks are loaded."""

    request_id: int
    slots: tuple[int, ...]
    slot_offsets: tuple[int, ...]
    """Byte offsets of the slots in the DE node's registered segment."""
    num_valid_de_blocks: int
    """Leading DE-side hit blocks read and verified; a miss or corrupt block ends the hit."""


@dataclass(frozen=True)
class PrefillDone:
    """Every prompt block's KV is in the DE buffer; `first_token` comes from the PE's logits."""

    request_id: int
    first_token: int
    first_logprobs: TokenLogprobs | None
    num_hit_blocks: int
    """Blocks whose KV came from storage; the DE persists the prompt's full blocks after it."""
    prefill_started_at: float
    prefill_done_at: float


@dataclass(frozen=True)
class Cancel:
    """Driver -> scheduler: stop a request early. The scheduler drops it if no engine has it
    yet (and reports an empty `TurnDone`), else forwards it to the DE node, whose engine ends
    the request at its next decode step (its `TurnDone` carries the tokens so far)."""

    request_id: int


@dataclass(frozen=True)
class TurnTokens:
    """A streaming request's tokens generated since its last report (DE -> scheduler ->
    driver); `TurnDone` still follows with all of them."""

    request_id: int
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] = ()
    """One per token when the request asked for logprobs."""


@dataclass(frozen=True)
class TurnDone:
    """A request finished decoding."""

    request_id: int
    output_ids: tuple[int, ...]
    first_token_at: float
    done_at: float
    logprobs: tuple[TokenLogprobs, ...] = ()
    """One per output token when the request asked for logprobs."""


@dataclass(frozen=True)
class RemoteCharge:
    """Bytes a transfer moved through an engine of the receiving node: its compute NIC's
    `port` ("rx" or "tx") is held for them, after the fact (the initiator paced the transfer
    with its own port), so the remote engine's later transfers queue behind them."""

    engine_id: int
    port: str
    num_bytes: int


@dataclass(frozen=True)
class NodeStats:
    """A node's counters (bytes per path, port busy time, buffer use): at shutdown, and
    while it runs when asked (`NodeConfig.stats_interval_s`, `is_final` False)."""

    node: int
    port_bytes: dict[str, int] = field(default_factory=dict)
    port_busy_s: dict[str, float] = field(default_factory=dict)
    bytes_by_path: dict[str, int] = field(default_factory=dict)
    store_counters: dict[str, int] = field(default_factory=dict)
    buffer_peak_slots: int = 0
    buffer_waits: int = 0
    num_batches: int = 0
    num_copies: int = 0
    engine_counters: dict[str, int] = field(default_factory=dict)
    """PE forward passes: `num_prefill_passes`, `num_prefill_entries` (requests or chunks run),
    `num_chunked_entries` (entries that were a chunk, not a request's whole remainder)."""
    estimator: str = ""
    """The PE pass-time estimator (prefill nodes), one line."""
    read_q_tokens: int = 0
    """Tokens queued for storage reads on this node's storage NIC now."""
    is_final: bool = True
    taken_at: float = 0.0
    """When the node took these counters (time.time)."""


@dataclass(frozen=True)
class NodeUp:
    """A node is running; peers connect to its segment with `segment`."""

    node: int
    segment: SegmentInfo


@dataclass(frozen=True)
class Peers:
    """Scheduler -> nodes: every node's segment, sent once all nodes are up."""

    segments: tuple[SegmentInfo, ...]


@dataclass(frozen=True)
class Shutdown:
    """Stop after finishing nothing further; reply with NodeStats."""


@dataclass(frozen=True)
class NodeFailed:
    """A node (or one of its threads) raised; the run is aborted with `error`."""

    node: int
    """-1: the scheduler process."""
    error: str
    """The exception, one line (`Type: message`)."""
    traceback: str = ""


Message = (
    Submitted
    | SchedulerStats
    | Fetch
    | Fetched
    | PrefillTask
    | DecodeTask
    | DeBufferReady
    | PrefillDone
    | TurnTokens
    | Cancel
    | TurnDone
    | NodeStats
    | RemoteCharge
    | NodeUp
    | Peers
    | Shutdown
    | NodeFailed
)


class Inbox(Protocol):
    """A queue of messages (`queue.Queue` for threads, `multiprocessing.Queue` for processes)."""

    def put(self, item: Any) -> None: ...

    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...


def is_parent_gone() -> bool:
    """In a node or scheduler process: the process that started it has died (killed without
    a chance to send Shutdown), so nobody will read what it sends; False in a thread."""
    parent = mp.parent_process()
    return parent is not None and not parent.is_alive()
