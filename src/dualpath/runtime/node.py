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
- one thread per engine (`engine_pe.PrefillEngine` / `engine_de.DecodeEngine`).
"""

from __future__ import annotations

import ctypes
import queue
import sys
import threading
import time
import traceback
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from dualpath.core.errors import SpecError
from dualpath.core.validate import positive, positive_int
from dualpath.runtime.buffers import BufferPool
from dualpath.runtime.estimator import ESTIMATORS, describe, make_estimator
from dualpath.runtime.kvlayout import KVLayout
from dualpath.runtime.messages import (
    DecodeTask,
    EngineLoad,
    Fetch,
    Fetched,
    Message,
    NodeFailed,
    NodeStats,
    NodeUp,
    Peers,
    PrefillTask,
    RemoteCharge,
    Shutdown,
    is_parent_gone,
)
from dualpath.runtime.store import BlockStore
from dualpath.runtime.traffic import NodeNics, Port, TrafficClass, TrafficManager, sleep_until
from dualpath.runtime.transfer import TransferEngine, make_transfer_engine


class Inbox(Protocol):
    """A queue of messages (`queue.Queue` for threads, `multiprocessing.Queue` for processes)."""

    def put(self, item: Any) -> None: ...

    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...


@dataclass(frozen=True)
class ModelSource:
    """How a node builds its model: `tiny` (random weights from `seed`), `smollm2`, or `path`
    (a local Llama/Qwen2 checkpoint folder)."""

    kind: str
    seed: int = 0
    path: str = ""
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.kind not in ("tiny", "smollm2", "path"):
            raise SpecError("model_source", "kind", self.kind, "must be tiny, smollm2 or path")
        if self.kind == "path" and not self.path:
            raise SpecError("model_source", "path", self.path, "needed for kind=path")


@dataclass(frozen=True)
class NodeConfig:
    """Everything a node process needs; pickled to it at start. Frozen, validated."""

    node: int
    is_prefill: bool
    num_engines: int
    layout: KVLayout
    model: ModelSource
    store_root: str
    buffer_bytes: int
    storage_nic_bytes_per_s: float
    compute_nic_bytes_per_s: float
    hbm_bytes: int
    is_layerwise: bool
    is_io_unpaced: bool = False
    """The Oracle: storage I/O, P-D transfers and copies move their bytes without pacing."""
    transfer_kind: str = "auto"
    shm_prefix: str = "dp"
    fetch_interval_s: float = 0.005
    chunk_bytes: int = 256 * 1024
    compute_quota_s: float = 0.3
    """PE forward-pass quota of estimated attention time (`engine_pe`, paper §6.2)."""
    max_batch_tokens: int | None = None
    estimator: str = "measured"
    """PE pass-time estimator: measured (fitted at start-up) or cost-model (`estimator.py`)."""
    stats_interval_s: float | None = None
    """Send the node's counters (`NodeStats`, not final) this often while it runs; None:
    only at shutdown."""

    def __post_init__(self) -> None:
        owner = f"node[{self.node}]"
        if self.stats_interval_s is not None:
            positive(owner, "stats_interval_s", self.stats_interval_s)
        positive_int(owner, "num_engines", self.num_engines)
        positive_int(owner, "buffer_bytes", self.buffer_bytes)
        positive(owner, "storage_nic_bytes_per_s", self.storage_nic_bytes_per_s)
        positive(owner, "compute_nic_bytes_per_s", self.compute_nic_bytes_per_s)
        positive_int(owner, "hbm_bytes", self.hbm_bytes)
        positive(owner, "fetch_interval_s", self.fetch_interval_s)
        positive(owner, "compute_quota_s", self.compute_quota_s)
        if self.max_batch_tokens is not None:
            positive_int(owner, "max_batch_tokens", self.max_batch_tokens)
        if self.estimator not in ESTIMATORS:
            raise SpecError(
                owner, "estimator", self.estimator, f"must be one of {', '.join(ESTIMATORS)}"
            )
        if self.buffer_bytes < self.layout.full_block_bytes:
            raise SpecError(
                owner,
                "buffer_bytes",
                self.buffer_bytes,
                f"smaller than one Full Block ({self.layout.full_block_bytes} bytes)",
            )

    @property
    def first_engine_id(self) -> int:
        """Engines follow `core.cluster`: node n holds engines `n*g .. n*g+g-1`."""
        return self.node * self.num_engines

    @property
    def shm_name(self) -> str:
        return f"{self.shm_prefix}n{self.node}"


def build_model(source: ModelSource) -> Any:
    """The layer-by-layer model of `source` (runtime.model / runtime.weights)."""
    from dualpath.runtime import weights

    if source.kind == "tiny":
        return weights.tiny_random_model(source.seed)
    if source.kind == "smollm2":
        return weights.load_smollm2()
    return weights.load_checkpoint(Path(source.path))


def model_tokenizer(source: ModelSource) -> Any:
    """The `Tokenizer` of `source` with its chat template: the checkpoint's own, or
    byte-level (ChatML) for `tiny`."""
    from dualpath.runtime import weights
    from dualpath.runtime.tokenizer import Tokenizer

    if source.kind == "tiny":
        return Tokenizer.byte_level(weights.tiny_config().vocab_size)
    if source.kind == "smollm2":  # the GGUF carries the vocabulary and the chat template
        return Tokenizer.from_gguf(weights.smollm2_gguf_path())
    return weights.load_tokenizer(Path(source.path))


def model_config(source: ModelSource) -> Any:
    """The `ModelConfig` of `source` without loading weights (what the driver needs)."""
    from dualpath.runtime import weights

    if source.kind == "tiny":
        return weights.tiny_config()
    folder = weights.smollm2_folder() if source.kind == "smollm2" else Path(source.path)
    return weights.config_from_hf(folder)


@dataclass
class ReadJob:
    """Allocate `num_slots` buffer slots, then read `blocks` (index, key) into slots[index].

    Invariant (block state): a block read here is "being read into a node buffer" until
    `done` is set, then "in a PE or DE buffer" until its slot is freed by the engine that
    copied it onward (or by the writer once it is persisted).
    """

    request_id: int
    num_slots: int
    blocks: list[tuple[int, bytes]]
    block_size: int
    on_done: Callable[[ReadJob], None]
    slots: list[int] = field(default_factory=list)
    num_valid_blocks: int = 0
    """Leading blocks of `blocks` read and verified (the rest are recomputed)."""
    done: threading.Event = field(default_factory=threading.Event)


class NodeContext:
    """What engines of a node share: pool, NICs, traffic manager, transfer engine, counters."""

    def __init__(self, cfg: NodeConfig, send: Callable[[int | None, Message], None],
                 unpersisted: Any = None) -> None:
        self.cfg = cfg
        self.layout = cfg.layout
        slot_bytes = cfg.layout.full_block_bytes
        self.pool = BufferPool(cfg.shm_name, slot_bytes, cfg.buffer_bytes // slot_bytes)
        self._pinned = _pin(self.pool)
        unpaced = float("inf")
        self.nics = NodeNics.create(
            cfg.node,
            cfg.num_engines,
            unpaced if cfg.is_io_unpaced else cfg.storage_nic_bytes_per_s,
            unpaced if cfg.is_io_unpaced else cfg.compute_nic_bytes_per_s,
            cfg.chunk_bytes,
        )
        self.tm = TrafficManager()
        self.transfer: TransferEngine = make_transfer_engine(
            cfg.transfer_kind, cfg.node, cfg.shm_name, self.pool.view, name_prefix=cfg.shm_prefix
        )
        self.send = send
        """`send(node, msg)`; node None = the scheduler."""
        self._lock = threading.Lock()
        self.bytes_by_path: dict[str, int] = defaultdict(int)
        self.read_q_tokens = 0
        self.read_queue: queue.Queue[ReadJob | None] = queue.Queue()
        self.write_queue: queue.Queue[tuple[bytes, int] | Callable[[], None] | None] = queue.Queue()
        """(key, slot) to persist, or a callback to run once every earlier write is done."""
        self.store_counters: dict[str, int] = defaultdict(int)
        self.unpersisted = unpersisted
        """Blocks whose persistence failed, per node (a shared array the driver reads live,
        `Cluster.num_unpersisted_blocks`; None: counted in `store_counters` only)."""
        self.engine_counters: dict[str, int] = defaultdict(int)
        self.estimator_desc = ""
        self.failure: list[tuple[str, str]] = []
        """(one-line error, traceback) of every thread that raised."""

    def unpin(self) -> None:
        """Undo `_pin` before the segment is unmapped (a later segment may be mapped at the same
        address, and CUDA refuses to register a range twice)."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._pinned)  # type: ignore[no-untyped-call]
            self._pinned = 0

    def close(self) -> None:
        """Release what `__init__` took, in reverse order: transfer engine, pinning, segment."""
        self.transfer.close()
        self.unpin()
        self.pool.close()

    def count(self, path: str, num_bytes: int) -> None:
        with self._lock:
            self.bytes_by_path[path] += num_bytes

    def charge(self, route: list[Port], num_bytes: int, path: str) -> None:
        """Pace `num_bytes` on `route` (KV traffic, low priority) and count them under `path`."""
        self.tm.charge(route, num_bytes, TrafficClass.LOW)
        self.count(path, num_bytes)

    def count_engine(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.engine_counters[name] += n

    def add_read_q(self, tokens: int) -> None:
        with self._lock:
            self.read_q_tokens += tokens

    def engine_index(self, engine_id: int) -> int:
        i = engine_id - self.cfg.first_engine_id
        if not 0 <= i < self.cfg.num_engines:
            raise SpecError(f"node[{self.cfg.node}]", "engine", engine_id, "not on this node")
        return i

    def stats(self) -> NodeStats:
        ports = self.nics.all_ports()
        return NodeStats(
            node=self.cfg.node,
            port_bytes={p.name: p.stats.total_bytes for p in ports},
            port_busy_s={p.name: p.stats.busy_s for p in ports},
            bytes_by_path=dict(self.bytes_by_path),
            store_counters=dict(self.store_counters),
            read_q_tokens=self.read_q_tokens,
            taken_at=time.time(),
            buffer_peak_slots=self.pool.peak_used,
            buffer_waits=self.pool.num_waits,
            num_batches=self.tm.num_batches,
            num_copies=self.tm.num_copies,
            engine_counters=dict(self.engine_counters),
            estimator=self.estimator_desc,
        )


def _pin(pool: BufferPool) -> int:
    """On CUDA, page-lock the buffer segment so copies between slots and engine memory run at
    full PCIe speed (the segment is shared memory, so it is registered rather than allocated
    pinned); returns its address, or 0 when nothing was pinned (no CUDA: pinning would fail)."""
    if not torch.cuda.is_available():
        return 0
    address = int(np.frombuffer(pool.view, dtype=np.uint8).ctypes.data)
    cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    err = cudart.cudaHostRegister(address, pool.capacity_bytes, 0)
    if int(err) == 0:
        return address
    # Unpinned copies still work, only slower; but a failed runtime call stays as CUDA's "last
    # error", which the next PyTorch CUDA call would raise as its own: clear it here.
    _clear_cuda_error()
    return 0


def _clear_cuda_error() -> None:
    """Reset CUDA's sticky "last error" with `cudaGetLastError` of the libcudart this process
    loaded (PyTorch's bindings do not expose it)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart" in line}
    for path in sorted(paths):
        ctypes.CDLL(path).cudaGetLastError()


def _reader_loop(ctx: NodeContext) -> None:
    """FIFO storage reads into buffer slots, paced on the storage NIC's read port."""
    store = BlockStore(ctx.cfg.store_root, ctx.layout.full_block_bytes, is_durable=False)
    while True:
        job = ctx.read_queue.get()
        if job is None:
            break
        job.slots = ctx.pool.alloc(job.num_slots)
        valid = 0
        is_broken = False
        for index, key in job.blocks:
            if not is_broken:
                # The emulated transfer runs while the real read happens (then we wait for it).
                done_at = ctx.nics.storage_read.reserve(ctx.layout.full_block_bytes)
                ok = store.get_into(key, ctx.pool.slot(job.slots[index]))
                ctx.count("snic_read", ctx.layout.full_block_bytes)
                sleep_until(done_at)
                if ok:
                    valid += 1
                else:
                    is_broken = True  # a missing/corrupt block ends the usable prefix
            ctx.add_read_q(-job.block_size)
        job.num_valid_blocks = valid
        for name in ("num_hits", "num_misses", "num_corrupt", "num_unreadable"):
            ctx.store_counters[name] = getattr(store.counters, name)
        job.done.set()
        job.on_done(job)


def _writer_loop(ctx: NodeContext) -> None:
    """Persist completed Full Blocks (atomic put), paced on the storage NIC's write port; the
    slot is freed only after the block is stored (its successor holds it).

    A put that fails (a full disk, a read-only store) skips that block: it is counted and will
    be a cache miss, recomputed, so serving goes on. The first failure is printed with why.
    """
    store = BlockStore(ctx.cfg.store_root, ctx.layout.full_block_bytes, is_durable=False)
    while True:
        item = ctx.write_queue.get()
        if item is None:
            break
        if callable(item):
            item()
            continue
        key, slot = item
        done_at = ctx.nics.storage_write.reserve(ctx.layout.full_block_bytes)
        try:
            store.put(key, ctx.pool.slot(slot), overwrite=False)
        except OSError as exc:
            if store.counters.num_failed_puts == 1:
                print(f"dualpath node {ctx.cfg.node}: warning: cannot persist KV blocks to "
                      f"{ctx.cfg.store_root} ({exc.strerror or exc}); skipping them (each is a "
                      "later cache miss, recomputed) and counting them as unpersisted_blocks",
                      file=sys.stderr, flush=True)
            ctx.store_counters["num_failed_puts"] = store.counters.num_failed_puts
            if ctx.unpersisted is not None:
                ctx.unpersisted[ctx.cfg.node] = store.counters.num_failed_puts
        ctx.count("snic_write", ctx.layout.full_block_bytes)
        sleep_until(done_at)
        ctx.pool.free([slot])
        ctx.store_counters["num_puts"] = store.counters.num_puts


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
    from dualpath.runtime.engine_de import DecodeEngine
    from dualpath.runtime.engine_pe import PrefillEngine

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
    threads.append(threading.Thread(target=_guard(ctx, lambda: _reader_loop(ctx)), daemon=True))
    threads.append(threading.Thread(target=_guard(ctx, lambda: _writer_loop(ctx)), daemon=True))
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
    from dualpath.runtime.model import SamplingParams

    prompt = [i % model.config.vocab_size for i in range(2 * layout.block_size + 1)]
    model.generate(prompt, SamplingParams(max_tokens=2, is_ignore_eos=True))


def _guard(ctx: NodeContext, fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # surfaced by the node loop
            ctx.failure.append((_one_line(exc), traceback.format_exc(limit=8)))

    return run
