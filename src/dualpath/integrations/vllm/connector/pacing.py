"""An emulated storage NIC for reads: `ReadPacer(gbps).charge(n)` returns no earlier than a
NIC of that rate would have delivered the `n` bytes, FIFO over every caller (thread-safe).
`with pacer.reading(n):` around the local read of those bytes books the NIC first, so the
read (from this machine's page cache, an artefact of the emulation) overlaps the NIC time
instead of adding to it: a block costs max(read, NIC), as when the NIC itself brings it.

The connector charges every Full Block it reads from the store (`storage_read_gbps` in its
extra config; one pacer per instance, i.e. per node's storage NIC), so that a run on one
machine, whose page cache serves the store at memory speed, is storage-bound the way the
paper's clusters are. Emulated hardware: the benchmarks say so wherever they report it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class ReadPacer:
    """Reads at most `gbps` Gb/s in total; a read waits for those queued before it."""

    def __init__(self, gbps: float) -> None:
        if not gbps > 0:
            raise ValueError(f"storage_read_gbps must be > 0, got {gbps}")
        self.bytes_per_s = gbps * 1e9 / 8
        self._free_at = 0.0
        self._lock = threading.Lock()
        self.num_bytes = 0
        self.busy_s = 0.0

    def book(self, num_bytes: int) -> float:
        """Queue `num_bytes` on the NIC now; returns when (time.monotonic) they are in."""
        now = time.monotonic()
        with self._lock:
            start = max(now, self._free_at)
            self._free_at = start + num_bytes / self.bytes_per_s
            self.num_bytes += num_bytes
            self.busy_s += num_bytes / self.bytes_per_s
            return self._free_at

    @staticmethod
    def wait_until(done: float) -> float:
        """Sleep until `done` (from `book`); returns the seconds slept."""
        wait = done - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        return max(wait, 0.0)

    def charge(self, num_bytes: int) -> float:
        """Wait until `num_bytes` more have crossed the NIC; returns the seconds waited."""
        return self.wait_until(self.book(num_bytes))

    @contextmanager
    def reading(self, num_bytes: int) -> Iterator[None]:
        """Around a local read of `num_bytes`: booked on entry, held until they are in."""
        done = self.book(num_bytes)
        yield
        self.wait_until(done)
