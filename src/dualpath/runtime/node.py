"""One node of the emulated cluster: its buffer pool, NICs, storage I/O threads and engines.

A node runs in its own process (or, for fast tests, a thread of the driver process) and talks
to the scheduler and to other nodes only through message queues (`messages.py`). Inside the
node, engines are threads sharing the node's buffer pool and NICs, as the GPUs of one server
share its DRAM and storage NIC.

Threads of a node:
- the main loop: receives messages, lets the group leader fetch work (pull, paper §6.1),
  hands tasks to the reader and the engines;
- the storage reader: allocates buffer slots for each assigned request (backpressure when the
  pool is full) and reads its hit Full Blocks through the storage NIC, FIFO; what is still
  queued is the node's `read_q` in tokens;
- the storage writer (decode nodes): persists completed Full Blocks through the storage NIC,
  then frees their slots;
- one thread per engine (`prefill_engine.PrefillEngine` / `decode_engine.DecodeEngine`).
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import torch

from dualpath.runtime.decode_engine import DecodeEngine
from dualpath.runtime.estimator import describe, make_estimator
from dualpath.runtime.kvlayout import KVLayout
from dualpath.runtime.messages import (
    DecodeTask,
    EngineLoad,
    Fetch,
    Fetched,
    Inbox,
    Message,
    NodeFailed,
    NodeUp,
    Peers,
    PrefillTask,
    RemoteCharge,
    Shutdown,
    is_parent_gone,
)
from dualpath.runtime.model.model_source import build_model
from dualpath.runtime.model.sampling import SamplingParams
from dualpath.runtime.node_context import NodeConfig, NodeContext
from dualpath.runtime.prefill_engine import PrefillEngine
from dualpath.runtime.storage_io import reader_loop, writer_loop


class Engine(Protocol):
    """What the node loop needs from a PE or DE engine thread."""

    def run(self) -> None: ...

    def stop(self) -> None: ...

    def load(self) -> EngineLoad: ...

    def on_message(self, msg: Message) -> None: ...


def run_node(
    cfg: NodeConfig,
    inbox: Inbox,
    outboxes: dict[int, Inbox],
    scheduler: Inbox,
    is_own_process: bool = False,
    unpersisted: Any = None,
) -> None:
    """Run node `cfg.node` until Shutdown; any failure is reported as NodeFailed.
    `unpersisted`: the driver's shared per-node count of blocks not persisted (see
    `NodeContext.unpersisted`)."""
    ctx: NodeContext | None = None
    if is_own_process:
        # Engines are threads; intra-op thread pools would only contend for the same cores.
        torch.set_num_threads(1)
    try:

        def send(node: int | None, msg: Message) -> None:
            (scheduler if node is None else outboxes[node]).put(msg)

        ctx = NodeContext(cfg, send, unpersisted)
        _serve(ctx, inbox)
    except _NodeThreadFailed as exc:
        scheduler.put(NodeFailed(cfg.node, exc.error, exc.trace))
    except BaseException as exc:  # the driver must learn why the node died
        scheduler.put(NodeFailed(cfg.node, _one_line(exc), traceback.format_exc(limit=8)))
    finally:
        if ctx is not None:
            ctx.close()


def _serve(ctx: NodeContext, inbox: Inbox) -> None:
    cfg = ctx.cfg
    model = build_model(cfg.model)
    _warm_up(model, ctx.layout)
    # Timed before the node reports up, so no other engine of this machine's run is busy yet.
    estimator = make_estimator(cfg.estimator, model) if cfg.is_prefill else None
    if estimator is not None:
        ctx.estimator_desc = describe(estimator)
    # Engines (a DE's KV cache is its share of engine memory, touched on allocation) are
    # built before the node reports up, so the run's first requests do not wait for them.
    engines: list[Engine] = []
    for i in range(cfg.num_engines):
        engine_id = cfg.first_engine_id + i
        if cfg.is_prefill:
            assert estimator is not None
            engines.append(PrefillEngine(ctx, engine_id, model, estimator))
        else:
            engines.append(DecodeEngine(ctx, engine_id, model))
    ctx.send(None, NodeUp(cfg.node, ctx.transfer.local_info()))
    while True:
        try:
            msg = inbox.get(timeout=_PARENT_POLL_S)
        except queue.Empty:
            if is_parent_gone():
                return
            continue
        if isinstance(msg, Peers):
            for seg in msg.segments:
                ctx.transfer.connect(seg)
            break
        if isinstance(msg, Shutdown):
            ctx.send(None, ctx.stats())
            return
    threads = [threading.Thread(target=_guard(ctx, e.run), daemon=True) for e in engines]
    threads.append(threading.Thread(target=_guard(ctx, lambda: reader_loop(ctx)), daemon=True))
    threads.append(threading.Thread(target=_guard(ctx, lambda: writer_loop(ctx)), daemon=True))
    for t in threads:
        t.start()
    is_clean = False
    try:
        by_request: dict[int, Engine] = {}
        is_fetch_out = False
        next_fetch_at = 0.0
        pending: deque[Message] = deque()
        early: dict[int, list[Message]] = defaultdict(list)
        next_parent_check = time.monotonic() + _PARENT_POLL_S
        next_stats_at = time.monotonic()
        while True:
            if ctx.failure:
                raise _NodeThreadFailed(*ctx.failure[0])
            now = time.monotonic()
            if cfg.stats_interval_s is not None and now >= next_stats_at:
                next_stats_at = now + cfg.stats_interval_s
                ctx.send(None, replace(ctx.stats(), is_final=False))
            if not is_fetch_out and now >= next_fetch_at:
                # read_q is a node value: every engine reports the same snapshot of it.
                read_q = ctx.read_q_tokens
                loads = tuple(replace(e.load(), read_q_tokens=read_q) for e in engines)
                ctx.send(None, Fetch(cfg.node, loads))
                is_fetch_out = True
            try:
                msg = pending.popleft() if pending else inbox.get(timeout=cfg.fetch_interval_s)
            except queue.Empty:
                if time.monotonic() >= next_parent_check:
                    next_parent_check = time.monotonic() + _PARENT_POLL_S
                    if is_parent_gone():
                        return  # orphaned: nobody will ever send Shutdown
                continue
            if isinstance(msg, Shutdown):
                break
            if isinstance(msg, Fetched):
                is_fetch_out = False
                next_fetch_at = time.monotonic() + cfg.fetch_interval_s
                for task in (*msg.prefill, *msg.decode):
                    assert isinstance(task, PrefillTask | DecodeTask)
                    engine_id = (task.pe_engine if isinstance(task, PrefillTask)
                                 else task.de_engine)
                    engine = engines[ctx.engine_index(engine_id)]
                    by_request[task.request_id] = engine
                    engine.on_message(task)
                    # A peer may have answered before our own fetch brought the task.
                    pending.extend(early.pop(task.request_id, []))
                continue
            if isinstance(msg, RemoteCharge):
                i = ctx.engine_index(msg.engine_id)
                nic = ctx.nics.compute_rx if msg.port == "rx" else ctx.nics.compute_tx
                nic[i].reserve(msg.num_bytes)
                continue
            request_id = getattr(msg, "request_id", None)
            if request_id is None:
                raise RuntimeError(f"node {cfg.node}: unexpected message {msg!r}")
            if request_id not in by_request:
                early[request_id].append(msg)
                continue
            by_request[request_id].on_message(msg)
        is_clean = True
    finally:
        # Also when the loop fails: a node thread of a failed node must not live on (with
        # its engine memory) in a process that carries on, as a server that restarts does.
        for e in engines:
            e.stop()
        ctx.read_queue.put(None)
        ctx.write_queue.put(None)
        for t in threads:
            t.join(timeout=10.0 if is_clean else 1.0)
    ctx.send(None, ctx.stats())


_PARENT_POLL_S = 1.0
"""How often an idle node checks that its driver process still lives."""


class _NodeThreadFailed(Exception):
    def __init__(self, error: str, trace: str) -> None:
        super().__init__(error)
        self.error = error
        self.trace = trace


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _warm_up(model: Any, layout: KVLayout) -> None:
    """One short generation before the node reports up, so first-call costs (kernel selection,
    allocator growth) are not charged to the first request of the run."""
    prompt = [i % model.config.vocab_size for i in range(2 * layout.block_size + 1)]
    model.generate(prompt, SamplingParams(max_tokens=2, is_ignore_eos=True))


def _guard(ctx: NodeContext, fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # surfaced by the node loop
            ctx.failure.append((_one_line(exc), traceback.format_exc(limit=8)))

    return run
