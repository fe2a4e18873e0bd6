"""An emulated PD-disaggregated cluster on one machine.

`Cluster` starts the scheduler (`scheduler_process.serve_scheduler`) and one node per process (or
each per thread, for fast tests) and wires their message queues; the calling process is only
the driver (a client): it submits turns to the scheduler and learns of finished ones (the agent
replay of `agent_replay.py`, the HTTP API of `dualpath.serve`). Nodes `[0, P)` are prefill nodes,
`[P, P+D)` decode nodes.

What is emulated and what is not: storage NICs (read and write per node) and compute NICs (tx and
rx per engine, including the CNIC-assisted H2D/D2H copies and the receiving engine's side of
P-D transfers) are rate limited; DRAM bandwidth (`M`) is not, and the high-priority class of the
compute NICs carries nothing (engines are single-GPU: no collectives). A PE packs each forward
pass under a compute quota (`sched.pack_prefill_batch`, chunking a prompt that does not fit) and
runs the packed requests back to back per layer (`prefill_engine`). Buffers must hold the
prompts in flight on both sides (`dualpath run` sizes them so); a PE and a DE buffer that are
both too small could otherwise wait on each other.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import multiprocessing.queues
import os
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from dualpath.core.blocks import block_keys, hit_blocks
from dualpath.core.errors import DualPathError, SpecError
from dualpath.runtime.kvlayout import KVLayout
from dualpath.runtime.messages import (
    Cancel,
    Inbox,
    Message,
    NodeFailed,
    NodeStats,
    NodeUp,
    Peers,
    SchedulerStats,
    Shutdown,
    Submitted,
    TurnDone,
    TurnSpec,
    TurnTokens,
)
from dualpath.runtime.model.model_source import model_config
from dualpath.runtime.model.sampling import SamplingParams
from dualpath.runtime.node import run_node
from dualpath.runtime.node_context import NodeConfig
from dualpath.runtime.run_config import RunConfig, scheduler_params
from dualpath.runtime.scheduler_process import SCHEDULER_NODE, SchedulerConfig, serve_scheduler
from dualpath.runtime.transfer import SegmentInfo
from dualpath.sched.types import WaitingRequest
from dualpath.store import BlockStore


class RunError(DualPathError):
    """A node failed or the run could not finish."""


def _check_memory(cfg: RunConfig) -> None:
    """SpecError if the cluster's buffers and KV memory exceed this machine's memory, before
    anything starts (later, a node's segment fails with ENOMEM or the kernel kills it)."""
    machine_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if cfg.memory_bytes > machine_bytes:
        raise SpecError(
            "run", "buffer_bytes", cfg.buffer_bytes,
            f"{cfg.num_nodes} node buffers plus {cfg.num_decode_nodes * cfg.engines_per_node} "
            f"decode engines x hbm_bytes={cfg.hbm_bytes} need {cfg.memory_bytes} bytes, more "
            f"than this machine's {machine_bytes}",
        )


_LIVENESS_POLL_S = 1.0
"""How often the driver checks, while waiting for a message, that its processes are alive."""


class Cluster:
    """Nodes started, connected and serving; `run` replays agents; `close` stops them."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        _check_memory(cfg)
        config = model_config(cfg.model)
        self.vocab_size: int = config.vocab_size
        self.layout: KVLayout = config.kv_layout(cfg.block_size)
        self.max_position_tokens: int = config.max_position_tokens
        # The driver looks up each prompt's cache hit (what `WaitingRequest` carries); the
        # scheduler process decides everything else.
        self._store = BlockStore(cfg.store_root, self.layout.full_block_bytes, is_durable=False)
        self._request_ids = itertools.count()
        self._lock = threading.Lock()
        self._prefix = f"dp{os.getpid() % 100000}{uuid.uuid4().hex[:6]}"
        self._procs: list[Any] = []
        self._is_closed = False
        self.failure_traceback = ""
        self._failed_nodes: set[int] = set()
        self.live_stats: dict[int, NodeStats] = {}
        """Each node's latest running counters (with `stats_interval_s`), by node id."""
        self._next_liveness_check = 0.0
        """Traceback of the node failure that aborted the run, if any (for debugging)."""
        self._num_fetches = 0
        is_process = cfg.launch == "process"
        # Written by each node's storage writer, read here while the cluster serves.
        self._unpersisted: Any = mp.get_context("spawn").RawArray("q", cfg.num_nodes)
        if is_process:
            ctx = mp.get_context("spawn")
            self._sched_q: Inbox = ctx.Queue()
            self._driver_q: Inbox = ctx.Queue()
            self._inboxes: dict[int, Inbox] = {n: ctx.Queue() for n in range(cfg.num_nodes)}
        else:
            self._sched_q = queue.Queue()
            self._driver_q = queue.Queue()
            self._inboxes = {n: queue.Queue() for n in range(cfg.num_nodes)}
        sched_cfg = SchedulerConfig(
            params=scheduler_params(cfg, self.layout),
            num_prefill_nodes=cfg.num_prefill_nodes,
            num_decode_nodes=cfg.num_decode_nodes,
            engines_per_node=cfg.engines_per_node,
            is_round_robin=cfg.switches.is_round_robin,
            forced_read_side="de" if cfg.path_mode == "de" else None,
            seed=cfg.seed,
        )
        sched_args = (sched_cfg, self._sched_q, self._inboxes, self._driver_q)
        if is_process:
            self._scheduler: Any = mp.get_context("spawn").Process(
                target=serve_scheduler, args=sched_args, name="dualpath-scheduler", daemon=True
            )
        else:
            self._scheduler = threading.Thread(
                target=serve_scheduler, args=sched_args, name="scheduler", daemon=True
            )
        self._scheduler.start()
        for n in range(cfg.num_nodes):
            ncfg = self._node_config(n)
            args = (ncfg, self._inboxes[n], self._inboxes, self._sched_q, is_process,
                    self._unpersisted)
            if is_process:
                proc: Any = mp.get_context("spawn").Process(
                    target=run_node, args=args, name=f"dualpath-node{n}", daemon=True
                )
            else:
                proc = threading.Thread(target=run_node, args=args, name=f"node{n}", daemon=True)
            proc.start()
            self._procs.append(proc)
        try:
            self._connect()
        except BaseException:
            self.close()
            raise

    def _node_config(self, node: int) -> NodeConfig:
        cfg = self.cfg
        return NodeConfig(
            node=node,
            is_prefill=node < cfg.num_prefill_nodes,
            num_engines=cfg.engines_per_node,
            layout=self.layout,
            model=cfg.model,
            store_root=cfg.store_root,
            buffer_bytes=cfg.buffer_bytes,
            storage_nic_bytes_per_s=cfg.storage_nic_bytes_per_s,
            compute_nic_bytes_per_s=cfg.compute_nic_bytes_per_s,
            is_io_unpaced=cfg.is_oracle,
            hbm_bytes=cfg.hbm_bytes,
            is_layerwise=cfg.is_layerwise,
            transfer_kind=cfg.transfer_kind,
            shm_prefix=self._prefix,
            fetch_interval_s=cfg.fetch_interval_s,
            compute_quota_s=cfg.compute_quota_s,
            max_batch_tokens=cfg.max_batch_tokens,
            estimator=cfg.estimator,
            stats_interval_s=cfg.stats_interval_s,
        )

    def _get(self, timeout_s: float, is_timeout_ok: bool = False) -> Message | None:
        deadline = time.monotonic() + timeout_s
        while True:
            # On a clock, not only when the queue is idle: under steady traffic from the
            # other nodes a killed one must still be noticed within a second.
            if time.monotonic() >= self._next_liveness_check:
                self._next_liveness_check = time.monotonic() + _LIVENESS_POLL_S
                self._raise_if_a_process_died()
            try:
                # Short waits: a process that dies before it can report (a crash while
                # starting, a kill) is noticed within a second, not at the timeout.
                msg: Message = self._driver_q.get(
                    timeout=min(_LIVENESS_POLL_S, max(0.0, deadline - time.monotonic()))
                )
                break
            except queue.Empty:
                self._raise_if_a_process_died()
                if time.monotonic() >= deadline:
                    if is_timeout_ok:
                        return None
                    raise RunError(
                        f"no message from the cluster within {timeout_s:g} s"
                    ) from None
        if isinstance(msg, NodeStats) and not msg.is_final:
            self.live_stats[msg.node] = msg
            return self._get(max(0.0, deadline - time.monotonic()), is_timeout_ok)
        if isinstance(msg, NodeFailed):
            self._failed_nodes.add(msg.node)
            self.failure_traceback = msg.traceback
            who = "scheduler" if msg.node == SCHEDULER_NODE else f"node {msg.node}"
            raise RunError(f"{who} failed: {msg.error}")
        return msg

    def _raise_if_a_process_died(self) -> None:
        """RunError naming the first node or scheduler process that exited without being
        told to (threads, in `launch="thread"`, report their failures as messages)."""
        for p, who in [(self._scheduler, "scheduler"),
                       *((p, f"node {n}") for n, p in enumerate(self._procs))]:
            if isinstance(p, mp.process.BaseProcess) and p.exitcode is not None:
                # Recorded, so `close` does not wait for stats it can never get.
                self._failed_nodes.add(SCHEDULER_NODE if p is self._scheduler
                                       else self._procs.index(p))
                raise RunError(f"{who} process exited with code {p.exitcode} before reporting "
                               "(see its output above)")

    def _connect(self, timeout_s: float = 300.0) -> None:
        segments: dict[int, SegmentInfo] = {}
        while len(segments) < self.cfg.num_nodes:
            msg = self._get(timeout_s)
            if isinstance(msg, NodeUp):
                segments[msg.node] = msg.segment
        peers = Peers(tuple(segments[n] for n in sorted(segments)))
        for inbox in self._inboxes.values():
            inbox.put(peers)

    @property
    def num_fetches(self) -> int:
        """Fetches the scheduler answered, known once `close` has its `SchedulerStats`."""
        return self._num_fetches

    @property
    def num_unpersisted_blocks(self) -> int:
        """KV blocks the nodes could not persist so far (a full disk, a read-only store): each
        is skipped, so a later request that would have hit it recomputes it."""
        return int(sum(self._unpersisted))

    @property
    def max_sequence_tokens(self) -> int:
        """The longest prompt + generation one request may have: a DE's engine memory and
        the model's positions bound it."""
        lay, cfg = self.layout, self.cfg
        pages = max(1, cfg.hbm_bytes // lay.full_block_bytes)
        return min(self.max_position_tokens, pages * cfg.block_size)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt a node buffer holds whole (one slot per block); a longer one
        fails the node that reads it."""
        return (self.cfg.buffer_bytes // self.layout.full_block_bytes) * self.cfg.block_size

    def submit(
        self, prompt: Sequence[int], sampling: SamplingParams, is_streaming: bool = False
    ) -> tuple[int, int]:
        """Submit one turn (thread-safe); returns `(request id, cache-hit tokens)`. Its
        `TurnDone` (and, if streaming, `TurnTokens`) come from `next_message`.

        The hit is the longest stored prefix of whole blocks, short of the last token (whose
        logits the prefill must compute): `core.blocks.hit_blocks`, as the vLLM router's.
        `sampling.seed` None: one derived from the run's seed and the request id. SpecError
        names a field that could never be served (more tokens than a DE's memory or the
        model's positions: the request would wait forever; a token id outside the vocabulary).
        A prompt longer than `max_prompt_tokens` fails its node (`BufferFullError`); a server
        checks it first.
        """
        cfg = self.cfg
        if not prompt:
            raise SpecError("request", "prompt", 0, "needs at least one token")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise SpecError("request", "prompt", bad,
                            f"token ids must be in [0, {self.vocab_size})")
        bad = next((t for t in sampling.stop_token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise SpecError("request", "stop_token_ids", bad,
                            f"token ids must be in [0, {self.vocab_size})")
        max_tokens = sampling.max_tokens
        if len(prompt) + max_tokens > self.max_sequence_tokens:
            raise SpecError("request", "max_tokens", max_tokens,
                            f"prompt ({len(prompt)}) + max_tokens exceeds the "
                            f"{self.max_sequence_tokens} tokens one sequence may hold")
        bs = cfg.block_size
        keys = block_keys(prompt, bs)
        num_hit = 0
        if cfg.is_cache_enabled:
            num_hit = hit_blocks(keys, len(prompt), self._store.contains, bs)
        with self._lock:
            rid = next(self._request_ids)
        if sampling.seed is None:
            sampling = replace(sampling, seed=cfg.seed * 1_000_003 + rid)
        self._sched_q.put(
            Submitted(
                request=WaitingRequest(rid, len(prompt), num_hit * bs, max_tokens),
                turn=TurnSpec(tuple(prompt), tuple(keys), num_hit),
                sampling=sampling,
                is_streaming=is_streaming,
            )
        )
        return rid, num_hit * bs

    def cancel(self, request_id: int) -> None:
        """End a submitted request early (thread-safe). Its `TurnDone` still comes, with the
        tokens generated so far (none if no engine had it yet); a request already done is
        left alone."""
        if not self._is_closed:
            self._sched_q.put(Cancel(request_id))

    def next_message(self, timeout_s: float) -> TurnDone | TurnTokens | None:
        """The next `TurnDone` or `TurnTokens`, or None after `timeout_s`; RunError when a
        node or the scheduler failed (one consumer at a time)."""
        while True:
            msg = self._get(timeout_s, is_timeout_ok=True)
            if msg is None or isinstance(msg, TurnDone | TurnTokens):
                return msg
            raise RunError(f"driver: unexpected message {type(msg).__name__}")

    def close(self, timeout_s: float = 30.0) -> list[NodeStats]:
        """Stop every node, then the scheduler; returns the nodes' counters (those that
        answered; their stats reach the driver through the scheduler)."""
        if self._is_closed:
            return []
        self._is_closed = True
        for inbox in self._inboxes.values():
            inbox.put(Shutdown())
        stats: dict[int, NodeStats] = {}
        deadline = time.monotonic() + timeout_s
        # A failed node sends no stats; it has already left its loop. A failed scheduler
        # forwards nothing.
        is_sched_alive = SCHEDULER_NODE not in self._failed_nodes
        while (
            is_sched_alive
            and len(stats) + len(self._failed_nodes) < len(self._procs)
            and time.monotonic() < deadline
        ):
            msg = self._next_msg(deadline)
            if isinstance(msg, NodeStats) and msg.is_final:
                stats[msg.node] = msg
            elif isinstance(msg, NodeFailed):
                self._failed_nodes.add(msg.node)
                is_sched_alive = msg.node != SCHEDULER_NODE
            elif msg is None:
                break
        if is_sched_alive:
            self._sched_q.put(Shutdown())
            while time.monotonic() < deadline:
                msg = self._next_msg(deadline)
                if isinstance(msg, SchedulerStats):
                    self._num_fetches = msg.num_fetches
                    break
                if msg is None:
                    break
        if not is_sched_alive:
            # Nodes whose last message goes to a dead scheduler's full queue cannot exit on
            # their own: give them a moment, then terminate them.
            deadline = min(deadline, time.monotonic() + 2.0)
        for p in [*self._procs, self._scheduler]:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if isinstance(p, mp.process.BaseProcess) and p.is_alive():
                p.terminate()
                p.join(timeout=5)
        readers = [(SCHEDULER_NODE, self._sched_q), *self._inboxes.items()]
        for n, q in readers:
            if n in self._failed_nodes and isinstance(q, mp.queues.Queue):
                # Messages a dead reader never took must not block this process's exit.
                q.cancel_join_thread()
        return [stats[n] for n in sorted(stats)]

    def _next_msg(self, deadline: float) -> Message | None:
        try:
            msg: Message = self._driver_q.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            return None
        return msg

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
