"""What a node's threads share: its frozen `NodeConfig`, the `NodeContext` (buffer pool,
NICs, traffic manager, transfer engine, counters, the storage queues) and the `ReadJob`s the
engines hand to the storage reader (`storage_io.py`)."""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dualpath.core.errors import SpecError
from dualpath.core.validate import positive, positive_int
from dualpath.runtime.estimator import ESTIMATORS
from dualpath.runtime.kvlayout import KVLayout
from dualpath.runtime.messages import Message, NodeStats
from dualpath.runtime.model.model_source import ModelSource
from dualpath.runtime.traffic import NodeNics, Port, TrafficClass, TrafficManager
from dualpath.runtime.transfer import TransferEngine, make_transfer_engine
from dualpath.transport.slots import SlotPool


class Budgets(Protocol):
    """A node's NIC rates, memory and prefill quota, as `RunConfig` (for every node) and
    `NodeConfig` (for one) both carry them; `check_budgets` validates them for both."""

    @property
    def storage_nic_bytes_per_s(self) -> float: ...
    @property
    def compute_nic_bytes_per_s(self) -> float: ...
    @property
    def buffer_bytes(self) -> int: ...
    @property
    def hbm_bytes(self) -> int: ...
    @property
    def compute_quota_s(self) -> float: ...
    @property
    def max_batch_tokens(self) -> int | None: ...
    @property
    def estimator(self) -> str: ...


def check_budgets(owner: str, cfg: Budgets) -> None:
    """SpecError naming `cfg`'s first bad NIC rate, memory size, quota or estimator."""
    positive(owner, "storage_nic_bytes_per_s", cfg.storage_nic_bytes_per_s)
    positive(owner, "compute_nic_bytes_per_s", cfg.compute_nic_bytes_per_s)
    positive_int(owner, "buffer_bytes", cfg.buffer_bytes)
    positive_int(owner, "hbm_bytes", cfg.hbm_bytes)
    positive(owner, "compute_quota_s", cfg.compute_quota_s)
    if cfg.max_batch_tokens is not None:
        positive_int(owner, "max_batch_tokens", cfg.max_batch_tokens)
    if cfg.estimator not in ESTIMATORS:
        raise SpecError(owner, "estimator", cfg.estimator,
                        f"must be one of {', '.join(ESTIMATORS)}")


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
    """PE forward-pass quota of estimated attention time (`prefill_engine`, paper §6.2)."""
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
        positive(owner, "fetch_interval_s", self.fetch_interval_s)
        check_budgets(owner, self)
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
        self.pool = SlotPool.sized(cfg.shm_name, slot_bytes, cfg.buffer_bytes)
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


def _pin(pool: SlotPool) -> int:
    """On CUDA, page-lock the buffer segment so copies between slots and engine memory run at
    full PCIe speed (the segment is shared memory, so it is registered rather than allocated
    pinned); returns its address, or 0 when nothing was pinned (no CUDA: pinning would fail)."""
    if not torch.cuda.is_available():
        return 0
    address = pool.address
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
