"""Traffic manager: rate-limited NIC ports with two priority classes (paper §4.3, §5.1).

Every byte the runtime moves is charged to the emulated NIC ports that would carry it on the
paper's hardware: a node's storage NIC (one `read` and one `write` port) and each engine's compute
NIC (full duplex: a `tx` port for bytes leaving host DRAM / engine memory towards the NIC, an `rx`
port for bytes the NIC writes into DRAM / engine memory). Local H2D and D2H copies also go
through the engine's compute NIC, as in the paper (CNIC-assisted copy), so they are charged too.

A `Port` is a serial resource whose clock is the transport's token-bucket `Pacer`
(`dualpath.transport.pacing`, the one the vLLM connector paces its storage reads with). A
transfer is cut into chunks; each chunk is *granted* by the port's arbiter and booked on the
pacer, advancing its clock by `bytes / rate`. The arbiter grants only while the clock is at
most `lookahead_s` ahead of wall time, so a sender is paced at the port rate, while the small
lookahead keeps the port busy despite thread wake-up jitter (the clock advances from where it
stands, not from `now`, while the port is backlogged).

Two traffic classes share a port by weighted deficit round robin: `HIGH` (model inference
traffic) and `LOW` (KV-cache traffic), weighted 99:1 by default like the paper's InfiniBand VL
arbitration, so KV traffic uses the spare bandwidth without starving.

Doorbell batching: `TrafficManager.send_batch` submits many Layer-Block copies as one request
(one arbiter round trip per chunk of the *batch*, not per block), which is what keeps the
per-Layer-Block overhead at a few microseconds (measured in `benchmarks/runtime/bench_runtime.py`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from dualpath.core.errors import SpecError
from dualpath.core.validate import positive, positive_int
from dualpath.transport.pacing import UNLIMITED, Pacer, sleep_until


class TrafficClass(IntEnum):
    """Priority class of a transfer on a compute NIC (paper: high- and low-priority VLs)."""

    HIGH = 0
    LOW = 1


@dataclass(frozen=True)
class PortConfig:
    """One direction of one emulated NIC. Frozen, validated."""

    name: str
    rate_bytes_per_s: float
    """Emulated bandwidth; `inf` disables pacing (the Oracle's bypassed I/O)."""
    chunk_bytes: int = 256 * 1024
    """Arbitration granule: a grant covers at most this many bytes."""
    lookahead_s: float = 0.002
    """How far the virtual clock may run ahead of wall time before senders wait."""
    high_weight: int = 99
    low_weight: int = 1

    def __post_init__(self) -> None:
        owner = f"port[{self.name}]"
        if self.rate_bytes_per_s != UNLIMITED:
            positive(owner, "rate_bytes_per_s", self.rate_bytes_per_s)
        positive_int(owner, "chunk_bytes", self.chunk_bytes)
        positive(owner, "lookahead_s", self.lookahead_s)
        positive_int(owner, "high_weight", self.high_weight)
        positive_int(owner, "low_weight", self.low_weight)

    @property
    def is_unlimited(self) -> bool:
        return self.rate_bytes_per_s == UNLIMITED


@dataclass
class _Request:
    num_bytes: int
    traffic_class: TrafficClass
    granted_until: float = 0.0
    is_granted: bool = False


@dataclass
class PortStats:
    """Counters of one port (bytes per class and the busy time they took)."""

    bytes_by_class: list[int] = field(default_factory=lambda: [0, 0])
    busy_s: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_class)


class Port:
    """One NIC direction: the transport's `Pacer` (its clock) with a two-class arbiter in front
    that decides whose chunk is booked next (thread safe)."""

    def __init__(self, config: PortConfig) -> None:
        self.config = config
        self.pacer = Pacer(config.rate_bytes_per_s, config.name)
        self._bytes_by_class = [0, 0]
        self._cond = threading.Condition()
        self._queues: tuple[deque[_Request], deque[_Request]] = (deque(), deque())
        # Deficit round robin: credit in bytes per class, refilled by weight * chunk.
        self._deficit = [0, 0]
        self._turn = TrafficClass.HIGH

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def stats(self) -> PortStats:
        """The port's counters now (a copy)."""
        with self._cond:
            return PortStats(list(self._bytes_by_class), self.pacer.busy_s)

    def grant(self, num_bytes: int, traffic_class: TrafficClass = TrafficClass.LOW) -> float:
        """Block until the arbiter grants `num_bytes` (<= chunk_bytes) to this caller; return
        the wall time at which those bytes have passed the port."""
        if self.config.is_unlimited:
            with self._cond:
                self._bytes_by_class[traffic_class] += num_bytes
            return self.pacer.book(num_bytes)
        req = _Request(num_bytes, traffic_class)
        with self._cond:
            self._queues[traffic_class].append(req)
            while not req.is_granted:
                now = time.monotonic()
                ahead_s = self.pacer.ahead_s(now)
                if ahead_s <= self.config.lookahead_s:
                    self._grant_next(now)
                    if req.is_granted:
                        break
                    self._cond.notify_all()
                    continue
                self._cond.wait(timeout=ahead_s - self.config.lookahead_s)
            self._cond.notify_all()
            return req.granted_until

    def _grant_next(self, now: float) -> None:
        """Book the head request of the class the DRR arbiter picks (caller holds the lock).

        Invariant: with both classes backlogged, over a DRR round HIGH is granted
        `high_weight * chunk_bytes` bytes for every `low_weight * chunk_bytes` of LOW.
        """
        cls = self._pick_class()
        if cls is None:
            return
        req = self._queues[cls].popleft()
        self._deficit[cls] -= req.num_bytes
        self._bytes_by_class[cls] += req.num_bytes
        req.granted_until = self.pacer.book(req.num_bytes, now)
        req.is_granted = True

    def _pick_class(self) -> TrafficClass | None:
        high, low = self._queues
        if not high and not low:
            return None
        if not low:
            self._deficit[TrafficClass.LOW] = 0
            return TrafficClass.HIGH
        if not high:
            self._deficit[TrafficClass.HIGH] = 0
            return TrafficClass.LOW
        weights = (self.config.high_weight, self.config.low_weight)
        # Both backlogged: serve the class whose turn it is while it has credit; else refill.
        for _ in range(3):
            cls = self._turn
            if self._deficit[cls] > 0:
                return cls
            other = TrafficClass(1 - cls)
            self._turn = other
            self._deficit[other] += weights[other] * self.config.chunk_bytes
        return self._turn

    def reserve(self, num_bytes: int, traffic_class: TrafficClass = TrafficClass.LOW) -> float:
        """Hold the port for `num_bytes` at once, without waiting; return the wall time at which
        they have passed. For a port with a single FIFO user (a node's storage reader or
        writer), so the caller can do the real I/O while the emulated transfer runs and then
        `sleep_until` the returned time: the port stays busy back to back."""
        with self._cond:
            self._bytes_by_class[traffic_class] += num_bytes
            done_at = self.pacer.book(num_bytes)
            self._cond.notify_all()
            return done_at


def _pace(ports: Sequence[Port], num_bytes: int, traffic_class: TrafficClass) -> float:
    """Charge `num_bytes` to every port of a route, chunk by chunk; return the finish time.

    The ports of a route are charged together per chunk (cut-through: a chunk occupies the
    source's and the destination's port over the same interval), so a route runs at its slowest
    port's rate.
    """
    finish = time.monotonic()
    if not ports:
        return finish
    chunk = min(p.config.chunk_bytes for p in ports)
    done = 0
    while done < num_bytes:
        n = min(chunk, num_bytes - done)
        for port in ports:
            finish = max(finish, port.grant(n, traffic_class))
        done += n
    return finish


@dataclass(frozen=True)
class Copy:
    """One descriptor of a batched transfer: copy `src` into `dst` (same length)."""

    src: memoryview
    dst: memoryview


class TrafficManager:
    """Moves bytes between buffers while charging them to NIC ports (one per node process).

    Every method copies real bytes and returns after the emulated transfer has completed.
    """

    def __init__(self) -> None:
        self.num_batches = 0
        self.num_copies = 0

    def send(
        self,
        route: Sequence[Port],
        src: memoryview,
        dst: memoryview,
        traffic_class: TrafficClass = TrafficClass.LOW,
    ) -> None:
        """One copy `src -> dst` charged to every port of `route`."""
        self.send_batch(route, [Copy(src, dst)], traffic_class)

    def send_batch(
        self,
        route: Sequence[Port],
        copies: Sequence[Copy],
        traffic_class: TrafficClass = TrafficClass.LOW,
    ) -> int:
        """Doorbell-batched copies: all descriptors are submitted as one transfer whose bytes
        are paced on `route`; the copies themselves run back to back. Returns bytes moved."""
        total = 0
        for c in copies:
            if c.src.nbytes != c.dst.nbytes:
                raise SpecError("copy", "nbytes", c.src.nbytes, f"dst holds {c.dst.nbytes}")
            c.dst[:] = c.src
            total += c.src.nbytes
        sleep_until(_pace(route, total, traffic_class))
        self.num_batches += 1
        self.num_copies += len(copies)
        return total

    def charge(
        self, route: Sequence[Port], num_bytes: int, traffic_class: TrafficClass = TrafficClass.LOW
    ) -> None:
        """Pace `num_bytes` moved by someone else (a file read, a tensor copy) on `route`."""
        sleep_until(_pace(route, num_bytes, traffic_class))


@dataclass(frozen=True)
class NodeNics:
    """The emulated NICs of one node: a storage NIC (read/write) and one compute NIC (tx/rx)
    per engine."""

    storage_read: Port
    storage_write: Port
    compute_tx: tuple[Port, ...]
    compute_rx: tuple[Port, ...]

    @staticmethod
    def create(
        node: int,
        num_engines: int,
        storage_nic_bytes_per_s: float,
        compute_nic_bytes_per_s: float,
        chunk_bytes: int = 256 * 1024,
    ) -> NodeNics:
        """Ports named `n<node>.snic.read`, `n<node>.e<i>.cnic.tx`, ..."""
        positive_int("node_nics", "num_engines", num_engines)

        def port(name: str, rate: float) -> Port:
            return Port(PortConfig(f"n{node}.{name}", rate, chunk_bytes=chunk_bytes))

        return NodeNics(
            storage_read=port("snic.read", storage_nic_bytes_per_s),
            storage_write=port("snic.write", storage_nic_bytes_per_s),
            compute_tx=tuple(
                port(f"e{i}.cnic.tx", compute_nic_bytes_per_s) for i in range(num_engines)
            ),
            compute_rx=tuple(
                port(f"e{i}.cnic.rx", compute_nic_bytes_per_s) for i in range(num_engines)
            ),
        )

    def all_ports(self) -> list[Port]:
        return [self.storage_read, self.storage_write, *self.compute_tx, *self.compute_rx]
