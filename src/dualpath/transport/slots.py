"""A pool of fixed-size slots (one Full Block each) in one named shared-memory segment.

A Full Block (`[num_layers, block_size, bytes_per_token_per_layer]`, layer-major) read from
storage lands in one slot with one `preadv`, and a Layer Block is a contiguous slice of it.
Slot bookkeeping lives only in the process that owns the pool; other processes learn slot
numbers (or addresses) through messages, map the segment by its name (`create=False`) and
move bytes in and out of it through a transfer engine, never through a shared Python object.

Invariant: a slot is free, or held by exactly one owner from `alloc` until that owner calls
`free`; the pool never takes a held slot back, so no transfer into or out of a slot can
overlap the next owner's. A full pool makes `alloc` wait (the runtime's backpressure) or, with
`timeout_s=0`, refuse at once (the caller then recomputes, or retries later).

Users: a runtime node's DRAM buffer (`runtime/node_context.py`), the vLLM decode node's staging
buffer (`integrations/vllm/connector/side_channel/staging.py`) and its worker's view of it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from dualpath.core.validate import positive_int
from dualpath.transport.transfer_error import BufferFullError


class SlotPool:
    """`num_slots` slots of `slot_bytes` in a shared-memory segment named `name` (None: a
    fresh name). Thread safe."""

    def __init__(self, name: str | None, slot_bytes: int, num_slots: int, *,
                 create: bool = True) -> None:
        owner = f"buffer[{name or 'anonymous'}]"
        positive_int(owner, "slot_bytes", slot_bytes)
        positive_int(owner, "num_slots", num_slots)
        size = slot_bytes * num_slots
        try:
            self._shm = shared_memory.SharedMemory(name=name, create=create, size=size)
        except OSError as exc:  # ENOMEM, a full /dev/shm: a one-line error, not a traceback
            raise BufferFullError(f"{owner}: cannot map {size} bytes of shared memory "
                                  f"({exc.strerror}); lower the buffer size") from None
        self.name = self._shm.name
        if self._shm.size < size:
            self._shm.close()
            raise BufferFullError(f"buffer[{self.name}]: segment holds {self._shm.size} "
                                  f"bytes, {num_slots} slots of {slot_bytes} need {size}")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._is_owner = create
        self.view = memoryview(self._shm.buf)[:size]
        anchor = ctypes.c_char.from_buffer(self.view)
        self.address = ctypes.addressof(anchor)
        """Virtual address of slot 0 in this process (what NIXL registers)."""
        del anchor
        self._free = list(range(num_slots - 1, -1, -1))
        self._cond = threading.Condition()
        self.peak_used = 0
        self.num_waits = 0

    @classmethod
    def sized(cls, name: str | None, slot_bytes: int, capacity_bytes: int) -> SlotPool:
        """As many slots of `slot_bytes` as `capacity_bytes` holds (at least one)."""
        if capacity_bytes < slot_bytes:
            raise BufferFullError(f"buffer[{name or 'anonymous'}]: {capacity_bytes} bytes hold "
                                  f"no slot of {slot_bytes} bytes; raise the buffer size")
        return cls(name, slot_bytes, capacity_bytes // slot_bytes)

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
        """Take `num` slots, waiting while the pool lacks them (None: as long as it takes; 0:
        refuse at once). More slots than the pool holds are refused at once."""
        if num > self.num_slots:
            raise BufferFullError(
                f"buffer[{self.name}]: {num} slots requested, pool holds {self.num_slots} "
                f"({self.capacity_bytes} bytes); raise the buffer size"
            )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            if len(self._free) < num:
                self.num_waits += 1
            while len(self._free) < num:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    wait = f"not free within {timeout_s} s" if timeout_s else "wanted, pool full"
                    raise BufferFullError(f"buffer[{self.name}]: {num} slots {wait} "
                                          f"({len(self._free)} of {self.num_slots} free)")
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
        """The bytes of slot `index`."""
        start = index * self.slot_bytes
        return self.view[start : start + self.slot_bytes]

    def offset(self, index: int) -> int:
        """Byte offset of slot `index` in the segment (what remote writers address)."""
        return index * self.slot_bytes

    def touch(self) -> None:
        """Write every page once now, so that no transfer into the pool faults on first use."""
        pages = np.frombuffer(self.view, dtype=np.uint8)
        pages.fill(0)
        del pages

    def unlink(self) -> None:
        """Remove the segment's name now (processes that mapped it keep it; the memory goes
        with the last mapping), so it cannot outlive them however they end."""
        with contextlib.suppress(OSError):
            self._shm.unlink()

    def close(self) -> None:
        """Detach; the creating process also unlinks the segment (unless a peer did)."""
        gc.collect()  # drop dead slot views and tensors that still reference the mapping
        try:
            self.view.release()
            self._shm.close()
        except BufferError:
            # A live tensor still views the segment: keep the mapping (it goes with the
            # process) and stop SharedMemory.__del__ from retrying the close.
            self._shm.close = lambda: None  # type: ignore[method-assign]
        if not self._is_owner:
            return
        try:
            self._shm.unlink()
        except FileNotFoundError:
            # A peer unlinked it once it had mapped it: balance this process's registration
            # with the resource tracker, which would otherwise warn of a leak at exit.
            with contextlib.suppress(Exception):
                resource_tracker.unregister(getattr(self._shm, "_name", "/" + self.name),
                                            "shared_memory")
