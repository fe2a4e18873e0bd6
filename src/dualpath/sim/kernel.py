"""A tiny deterministic discrete-event kernel: a heap of `(time_s, seq, callback)`.

Determinism: events at equal times run in scheduling order (`seq` breaks ties), callbacks never
consult wall clocks or global random state, so the same inputs give byte-identical results.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

Callback = Callable[[], None]
_MIN_COMPACT = 4096


class EventLoop:
    """Virtual time in float seconds. `at`/`after` schedule; `cancel` lazily drops an event."""

    __slots__ = ("_cancelled", "_heap", "_seq", "now_s", "num_events")

    def __init__(self) -> None:
        self.now_s = 0.0
        self.num_events = 0
        self._seq = 0
        self._heap: list[tuple[float, int, Callback]] = []
        self._cancelled: set[int] = set()

    def at(self, time_s: float, callback: Callback) -> int:
        """Schedule `callback` at absolute `time_s` (never in the past); returns a handle."""
        if time_s < self.now_s:
            time_s = self.now_s
        self._seq += 1
        heapq.heappush(self._heap, (time_s, self._seq, callback))
        return self._seq

    def after(self, delay_s: float, callback: Callback) -> int:
        """Schedule `callback` `delay_s` seconds from now; returns a handle."""
        return self.at(self.now_s + delay_s, callback)

    def cancel(self, handle: int) -> None:
        """Drop a scheduled event (it is skipped when it reaches the top of the heap).

        When cancelled events are more than half the heap, it is rebuilt without them (in
        place: `run` holds it). A flow re-rated many times before it ends leaves one cancelled
        completion per re-rate, and at the paper's scale those would otherwise pile up far
        ahead of the clock (each holding its flow), growing the heap and every push and pop on
        it. The order of the remaining events is their (time, seq) order either way."""
        cancelled = self._cancelled
        cancelled.add(handle)
        heap = self._heap
        if len(cancelled) > _MIN_COMPACT and 2 * len(cancelled) > len(heap):
            heap[:] = [e for e in heap if e[1] not in cancelled]
            heapq.heapify(heap)
            cancelled.clear()

    def run(
        self, until_s: float = float("inf"), should_stop: Callable[[], bool] | None = None
    ) -> None:
        """Run events in (time, seq) order until none are left, `until_s` is passed or
        `should_stop()` becomes true (checked after each event)."""
        heap, cancelled = self._heap, self._cancelled
        while heap:
            time_s, seq, callback = heap[0]
            if time_s > until_s:
                break
            heapq.heappop(heap)
            if cancelled and seq in cancelled:
                cancelled.discard(seq)
                continue
            self.now_s = time_s
            self.num_events += 1
            callback()
            if should_stop is not None and should_stop():
                break

    @property
    def is_idle(self) -> bool:
        """No live events are left."""
        return len(self._heap) <= len(self._cancelled)
