"""A node's DRAM buffer pool: PE buffer / DE buffer slots in one shared-memory segment.

The pool is one `multiprocessing.shared_memory` segment cut into fixed slots of one Full Block
each (`[num_layers, block_size, bytes_per_token_per_layer]`, layer-major), so a Layer Block is a
contiguous slice of a slot and a Full Block read from storage lands in one slot with one
`preadv`. Slot bookkeeping lives only in the owning node process; other processes learn slot
numbers through messages and write into them through a transfer engine (`transfer.py`), never
through a shared Python object.

Backpressure: `alloc` blocks while the pool lacks free slots (the paper's bounded DRAM buffer);
a request larger than the whole pool fails at once instead of waiting forever.
"""

from __future__ import annotations

import gc
import threading
import time
from multiprocessing import shared_memory

from dualpath.core.errors import DualPathError
from dualpath.core.validate import positive_int


class BufferFullError(DualPathError):
    """A buffer allocation that can never be satisfied, or that timed out."""


class BufferPool:
    """`num_slots` Full-Block slots of `slot_bytes` in a named shared-memory segment.

    Thread safe. Invariant: a slot is either free (in `_free`) or owned by exactly one request
    until that request calls `free`; `num_free + num_used == num_slots`.
    """

    def __init__(self, name: str, slot_bytes: int, num_slots: int, *, create: bool = True) -> None:
        positive_int(f"buffer[{name}]", "slot_bytes", slot_bytes)
        positive_int(f"buffer[{name}]", "num_slots", num_slots)
        self.name = name
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        size = slot_bytes * num_slots
        try:
            self._shm = shared_memory.SharedMemory(name=name, create=create, size=size)
        except OSError as exc:  # ENOMEM, a full /dev/shm: a one-line error, not a traceback
            raise BufferFullError(f"buffer[{name}]: cannot map {size} bytes of shared memory "
                                  f"({exc.strerror}); lower the DRAM buffer size") from None
        self._is_owner = create
        self.view = memoryview(self._shm.buf)[:size]
        self._free = list(range(num_slots - 1, -1, -1))
        self._cond = threading.Condition()
        self.peak_used = 0
        self.num_waits = 0

    @property
    def num_free(self) -> int:
        with self._cond:
            return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - self.num_free

    @property
    def capacity_bytes(self) -> int:
        return self.slot_bytes * self.num_slots

    def alloc(self, num: int, timeout_s: float | None = None) -> list[int]:
        """Take `num` slots, blocking while the pool is full (backpressure)."""
        if num > self.num_slots:
            raise BufferFullError(
                f"buffer[{self.name}]: {num} slots requested, pool holds {self.num_slots} "
                f"({self.capacity_bytes} bytes); raise the DRAM buffer size"
            )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            if len(self._free) < num:
                self.num_waits += 1
            while len(self._free) < num:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise BufferFullError(
                        f"buffer[{self.name}]: {num} slots not free within {timeout_s} s "
                        f"({len(self._free)} of {self.num_slots} free)"
                    )
                self._cond.wait(timeout=remaining)
            slots = [self._free.pop() for _ in range(num)]
            self.peak_used = max(self.peak_used, self.num_slots - len(self._free))
            return slots

    def free(self, slots: list[int]) -> None:
        """Return slots to the pool and wake blocked allocators."""
        with self._cond:
            for s in slots:
                if not 0 <= s < self.num_slots or s in self._free:
                    raise BufferFullError(f"buffer[{self.name}]: slot {s} freed twice or unknown")
                self._free.append(s)
            self._cond.notify_all()

    def slot(self, index: int) -> memoryview:
        """The Full-Block bytes of slot `index`."""
        start = index * self.slot_bytes
        return self.view[start : start + self.slot_bytes]

    def offset(self, index: int) -> int:
        """Byte offset of slot `index` in the segment (what remote writers address)."""
        return index * self.slot_bytes

    def close(self) -> None:
        """Detach; the creating process also unlinks the segment."""
        gc.collect()  # drop dead slot views and tensors that still reference the mapping
        try:
            self.view.release()
            self._shm.close()
        except BufferError:
            # A live tensor still views the segment: keep the mapping (it goes with the
            # process) and stop SharedMemory.__del__ from retrying the close.
            self._shm.close = lambda: None  # type: ignore[method-assign]
        if self._is_owner:
            self._shm.unlink()
