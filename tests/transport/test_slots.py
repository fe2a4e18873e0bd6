"""The slot pool: held slots are never handed out again until freed; a full pool waits
(backpressure) or refuses; another process maps it by name."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dualpath.transport.slots import SlotPool
from dualpath.transport.transfer_error import BufferFullError


@pytest.fixture
def pool() -> Iterator[SlotPool]:
    p = SlotPool(f"dps{uuid.uuid4().hex[:8]}", 4096, 4)
    yield p
    p.close()


def test_alloc_blocks_until_slots_are_freed(pool: SlotPool) -> None:
    held = pool.alloc(4)
    assert pool.num_free == 0
    got: list[list[int]] = []
    waiter = threading.Thread(target=lambda: got.append(pool.alloc(2)))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and not got  # backpressure: no slot is free
    pool.free(held[:2])
    waiter.join(timeout=10)
    assert not waiter.is_alive() and sorted(got[0]) == sorted(held[:2])
    assert pool.num_waits == 1 and pool.peak_used == 4


def test_a_full_pool_refuses_and_never_frees_held_slots(pool: SlotPool) -> None:
    with pytest.raises(BufferFullError, match="5 slots requested, pool holds 4"):
        pool.alloc(5)
    a = pool.alloc(3)
    with pytest.raises(BufferFullError, match="2 slots wanted, pool full"):
        pool.alloc(2, timeout_s=0)
    with pytest.raises(BufferFullError, match="not free within"):
        pool.alloc(2, timeout_s=0.01)
    assert pool.num_free == 1  # the refusals took nothing
    b = pool.alloc(1, timeout_s=0)
    assert not set(a) & set(b)
    pool.free(a)
    with pytest.raises(BufferFullError, match="freed twice"):
        pool.free(a[:1])


def test_sized_in_bytes() -> None:
    p = SlotPool.sized(None, 1000, 4_500)
    try:
        assert p.num_slots == 4 and p.capacity_bytes == 4000
    finally:
        p.close()
    with pytest.raises(BufferFullError, match="hold no slot"):
        SlotPool.sized(None, 1000, 999)


def test_slots_are_disjoint_views_of_one_segment(pool: SlotPool) -> None:
    pool.slot(2)[:4] = b"abcd"
    assert bytes(pool.view[pool.offset(2) : pool.offset(2) + 4]) == b"abcd"
    assert pool.offset(3) - pool.offset(2) == pool.slot_bytes
    pool.touch()
    assert not any(pool.view)


def test_another_mapping_sees_the_bytes_and_the_name_can_go_early(pool: SlotPool) -> None:
    peer = SlotPool(pool.name, pool.slot_bytes, pool.num_slots, create=False)
    try:
        pool.slot(1)[:3] = b"xyz"
        assert bytes(peer.slot(1)[:3]) == b"xyz"
        peer.unlink()  # both map it: the name is no longer needed
        assert not Path(f"/dev/shm/{pool.name}").exists()
        peer.slot(0)[:2] = b"ok"
        assert bytes(pool.slot(0)[:2]) == b"ok"
    finally:
        peer.close()
    # The owner's close copes with the name being gone already.


def test_a_segment_too_small_for_its_slots_is_refused(pool: SlotPool) -> None:
    with pytest.raises(BufferFullError, match="segment holds"):
        SlotPool(pool.name, pool.slot_bytes, 100, create=False)
