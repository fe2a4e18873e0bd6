"""One emulated NIC direction: a token bucket in its virtual-clock form.

`Pacer.book(n)` queues `n` bytes behind every byte booked before them (FIFO over all callers,
thread-safe) and returns the time (`time.monotonic`) at which a NIC of the pacer's rate has
carried them: the clock `free_at` advances by `n / rate` from `max(now, free_at)`. A caller
books first, does its real I/O (a file read, a copy) while the emulated transfer runs, then
`sleep_until` the returned time, so a transfer costs max(I/O, NIC time), as when the NIC
itself moves the bytes, and a backlogged NIC stays busy back to back. `ahead_s` is how far the
clock runs ahead of now: a sender that books only while it is below a small bound (the
bucket's depth) is held to the rate.

Used by the runtime's NIC ports (`runtime/traffic.py` layers two priority classes on it) and
by the vLLM connector's storage reads (`storage_read_gbps`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from dualpath.core.errors import SpecError

UNLIMITED = float("inf")
"""A rate that disables pacing (the Oracle's bypassed I/O): bytes are counted, never waited for."""


def sleep_until(t: float) -> float:
    """Sleep until monotonic time `t` (no-op if it has passed); returns the seconds slept."""
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    return max(delay, 0.0)


class Pacer:
    """A NIC direction of `rate_bytes_per_s`; counts the bytes it carried and its busy time."""

    def __init__(self, rate_bytes_per_s: float, name: str = "pacer") -> None:
        if not (rate_bytes_per_s > 0):
            raise SpecError(f"pacer[{name}]", "rate_bytes_per_s", rate_bytes_per_s,
                            "must be > 0 (inf: unpaced)")
        self.name = name
        self.rate_bytes_per_s = rate_bytes_per_s
        self._free_at = 0.0
        self._lock = threading.Lock()
        self.num_bytes = 0
        self.busy_s = 0.0

    @classmethod
    def from_gbps(cls, gbps: float, name: str) -> Pacer:
        """A pacer of `gbps` Gb/s; a rate that is not > 0 is refused naming `<name>_gbps`."""
        if not (gbps > 0):
            raise SpecError("pacer", f"{name}_gbps", gbps, "must be > 0")
        return cls(gbps * 1e9 / 8, name)

    @property
    def is_unlimited(self) -> bool:
        return self.rate_bytes_per_s == UNLIMITED

    def book(self, num_bytes: int, now: float | None = None) -> float:
        """Queue `num_bytes` now; returns when (time.monotonic) they have passed."""
        if now is None:
            now = time.monotonic()
        with self._lock:
            self.num_bytes += num_bytes
            if self.is_unlimited:
                return now
            duration = num_bytes / self.rate_bytes_per_s
            self._free_at = max(now, self._free_at) + duration
            self.busy_s += duration
            return self._free_at

    def ahead_s(self, now: float | None = None) -> float:
        """How far the clock runs ahead of `now` (<= 0: idle)."""
        with self._lock:
            return self._free_at - (time.monotonic() if now is None else now)

    def charge(self, num_bytes: int) -> float:
        """Wait until `num_bytes` more have passed; returns the seconds waited."""
        return sleep_until(self.book(num_bytes))

    @contextmanager
    def reading(self, num_bytes: int) -> Iterator[None]:
        """Around a local read of `num_bytes`: booked on entry, held until they are in."""
        done = self.book(num_bytes)
        yield
        sleep_until(done)
