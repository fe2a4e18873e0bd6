"""`StagingPool`: the decode node's staging buffer, the transport's `SlotPool` held per transfer.

Invariant (the block-state rule applied to staging slots): a slot belongs to at most one
transfer, from `alloc` until that transfer is released, or has been idle for `ttl_s`; the pool
never takes slots back to make room. A transfer's bytes can be in flight while it holds them
(a store read in `Stage`, the prefill worker's NIXL READ of staged slots or WRITE into
allocated ones), so a full pool refuses (`BufferFullError`; the prefill side then recomputes,
as on any failure) rather than hand a live slot to another transfer. A store read in progress
pins its transfer: it neither expires nor goes back on `release` until the read ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from dualpath.integrations.vllm.connector.side_channel.wire import SideChannelError
from dualpath.transport.nixl import WAIT_TIMEOUT_S
from dualpath.transport.slots import SlotPool


@dataclass
class _Xfer:
    slots: dict[int, int] = field(default_factory=dict)
    """block index (in the request) -> slot."""
    staged: set[int] = field(default_factory=set)
    """Blocks read from storage here (valid once staged)."""
    is_committed: bool = False
    """The prefill worker's pushed blocks are complete."""
    crcs: dict[int, int] = field(default_factory=dict)
    """block index -> the CRC32C its writer gave for its slot's bytes."""
    num_reading: int = 0
    """Store reads (`Stage`) writing into the transfer's slots now."""
    is_released: bool = False
    """Released while a read was in progress: its slots go back when the read ends."""
    touched_at: float = field(default_factory=time.monotonic)


class StagingPool:
    """Full Block slots of a `SlotPool`, handed out per transfer. Thread-safe."""

    def __init__(self, slots: SlotPool, ttl_s: float = 600.0) -> None:
        """`ttl_s`: how long a transfer may sit idle before its slots go back (its request
        never reached this decode instance). It must exceed the longest a peer's NIXL
        transfer waits (`WAIT_TIMEOUT_S`): until then an idle transfer may have one in
        flight."""
        if not ttl_s > WAIT_TIMEOUT_S:
            raise ValueError(f"staging ttl_s must exceed the NIXL wait timeout "
                             f"({WAIT_TIMEOUT_S:g} s), got {ttl_s}")
        self.slots = slots
        self.full_block_bytes = slots.slot_bytes
        self.num_slots = slots.num_slots
        self.base = slots.address
        self.buffer = torch.frombuffer(slots.view, dtype=torch.uint8)
        self.ttl_s = ttl_s
        self._xfers: dict[str, _Xfer] = {}
        self._lock = threading.Lock()
        self.num_expired = 0

    def address(self, slot: int) -> int:
        return self.base + slot * self.full_block_bytes

    def view(self, slot: int) -> torch.Tensor:
        lo = slot * self.full_block_bytes
        return self.buffer[lo:lo + self.full_block_bytes]

    @property
    def num_free(self) -> int:
        return self.slots.num_free

    def alloc(self, xfer: str, blocks: Sequence[int], *, is_read: bool = False) -> list[int]:
        """Slots for `blocks` of `xfer` (a block given twice keeps its slot); a pool without
        enough free slots refuses (`BufferFullError`) and takes none. `is_read`: a store read
        into them starts now and ends with `mark_staged`."""
        with self._lock:
            now = time.monotonic()
            self._expire_idle(now)
            x = self._xfers.get(xfer)
            if x is not None and x.is_released:
                raise SideChannelError(f"transfer {xfer} is being released")
            need = [b for b in blocks if x is None or b not in x.slots]
            taken = self.slots.alloc(len(need), timeout_s=0) if need else []
            if x is None:
                x = self._xfers[xfer] = _Xfer()
            x.slots.update(zip(need, taken, strict=True))
            x.touched_at = now
            x.num_reading += is_read
            return [x.slots[b] for b in blocks]

    def mark_staged(self, xfer: str, blocks: Sequence[int]) -> None:
        """The store read of an `alloc(..., is_read=True)` ended: `blocks` of `xfer` hold
        their stored bytes. A transfer released meanwhile (its prefill gave up and
        recomputed) gets its slots back now and is a `SideChannelError`."""
        with self._lock:
            x = self._xfers.get(xfer)
            if x is None:
                raise SideChannelError(f"transfer {xfer} was released while staging")
            x.num_reading = max(0, x.num_reading - 1)
            x.touched_at = time.monotonic()
            if x.is_released:
                if x.num_reading == 0:
                    self._drop(xfer)
                raise SideChannelError(f"transfer {xfer} was released while staging")
            x.staged.update(blocks)

    def commit(self, xfer: str, crcs: Mapping[int, int] | None = None) -> None:
        """The pushed blocks of `xfer` are complete (`crcs`: block index -> the digest of its
        slot's bytes as written, `connector.digest`, checked by the reader)."""
        with self._lock:
            x = self._xfers.get(xfer)
            if x is None or x.is_released:
                raise SideChannelError(f"unknown transfer {xfer}")
            x.is_committed = True
            x.crcs.update(crcs or {})
            x.touched_at = time.monotonic()

    def lookup(self, xfer: str, blocks: Sequence[int]) -> list[int | None]:
        """The slot of each block that holds valid bytes (staged, or pushed and committed)."""
        with self._lock:
            x = self._xfers.get(xfer)
            if x is None or x.is_released:
                return [None] * len(blocks)
            return [x.slots[b] if b in x.slots and (b in x.staged or x.is_committed) else None
                    for b in blocks]

    def checksums(self, xfer: str, blocks: Sequence[int]) -> list[int | None]:
        """The CRC32C each block's writer gave (None: none)."""
        with self._lock:
            x = self._xfers.get(xfer)
            return [None if x is None else x.crcs.get(b) for b in blocks]

    def release(self, xfer: str) -> None:
        """`xfer`'s slots go back to the pool (once its store reads in progress end)."""
        with self._lock:
            x = self._xfers.get(xfer)
            if x is None:
                return
            if x.num_reading:
                x.is_released = True
            else:
                self._drop(xfer)

    def expire_idle(self, now: float | None = None) -> int:
        """Release every transfer idle for over `ttl_s` at `now`; returns how many."""
        with self._lock:
            return self._expire_idle(time.monotonic() if now is None else now)

    def _expire_idle(self, now: float) -> int:
        idle = [name for name, x in self._xfers.items()
                if not x.num_reading and now - x.touched_at > self.ttl_s]
        for name in idle:
            self._drop(name)
        self.num_expired += len(idle)
        return len(idle)

    def _drop(self, xfer: str) -> None:
        self.slots.free(list(self._xfers.pop(xfer).slots.values()))

    def close(self) -> None:
        """Drop this view of the buffer and close the slot pool."""
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.slots.close()
