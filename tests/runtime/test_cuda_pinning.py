"""The buffer segment's CUDA page-locking (runs only where CUDA is present; CI has none).

A segment is registered with `cudaHostRegister` on creation and unregistered before it is
unmapped; a failed registration falls back to unpinned copies without leaving CUDA's sticky
error for the next PyTorch call to raise."""

from __future__ import annotations

import uuid

import pytest
import torch

from dualpath.runtime.node_context import _pin
from dualpath.transport.slots import SlotPool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _pool() -> SlotPool:
    return SlotPool(f"pin{uuid.uuid4().hex[:8]}", 1 << 16, 8)


def test_pin_registers_and_a_second_pin_of_the_same_range_falls_back_cleanly() -> None:
    pool = _pool()
    try:
        address = _pin(pool)
        assert address != 0
        assert _pin(pool) == 0  # already registered: refused, and the error is cleared
        x = torch.ones(4, device="cuda") * 2  # would raise if the error were left sticky
        torch.cuda.synchronize()
        assert x.sum().item() == 8
        torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]
    finally:
        pool.close()


def test_copies_between_a_pinned_slot_and_engine_memory_round_trip() -> None:
    pool = _pool()
    address = _pin(pool)
    try:
        slot = torch.frombuffer(pool.slot(3), dtype=torch.uint8)
        slot.copy_(torch.arange(slot.numel(), dtype=torch.int64).remainder(251).to(torch.uint8))
        on_gpu = slot.to("cuda", non_blocking=True)
        back = torch.empty_like(slot)
        back.copy_(on_gpu)
        assert torch.equal(back, slot)
    finally:
        if address:
            torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]
        pool.close()
