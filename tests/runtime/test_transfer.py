"""Transfer engines (shared memory, NIXL when installed) and the node buffer pool."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest

from dualpath.runtime.buffers import BufferFullError, BufferPool
from dualpath.runtime.transfer import (
    TransferError,
    is_nixl_available,
    make_transfer_engine,
)


@pytest.fixture
def pools() -> Iterator[tuple[BufferPool, BufferPool]]:
    tag = uuid.uuid4().hex[:8]
    a = BufferPool(f"dpt{tag}a", 4096, 4)
    b = BufferPool(f"dpt{tag}b", 4096, 4)
    yield a, b
    a.close()
    b.close()


KINDS = [
    "shm",
    pytest.param(
        "nixl", marks=pytest.mark.skipif(not is_nixl_available(), reason="nixl not installed")
    ),
]


@pytest.mark.parametrize("kind", KINDS)
def test_write_and_read_move_bytes_between_segments(
    pools: tuple[BufferPool, BufferPool], kind: str
) -> None:
    a, b = pools
    ea = make_transfer_engine(kind, 0, a.name, a.view, name_prefix=a.name)
    eb = make_transfer_engine(kind, 1, b.name, b.view, name_prefix=b.name)
    try:
        ea.connect(eb.local_info())
        eb.connect(ea.local_info())
        a.slot(0)[:] = bytes(range(256)) * 16
        # One batch of two descriptors: slot 0's halves land swapped in b's slot 2.
        moved = ea.write(1, [(0, b.offset(2) + 2048, 2048), (2048, b.offset(2), 2048)])
        assert moved == 4096
        assert bytes(b.slot(2)[2048:]) == bytes(a.slot(0)[:2048])
        assert bytes(b.slot(2)[:2048]) == bytes(a.slot(0)[2048:])
        b.slot(3)[:8] = b"abcdefgh"
        assert ea.read(1, [(a.offset(1), b.offset(3), 8)]) == 8
        assert bytes(a.slot(1)[:8]) == b"abcdefgh"
        with pytest.raises(TransferError, match="outside"):
            ea.write(1, [(0, b.capacity_bytes - 4, 8)])
        with pytest.raises(TransferError, match="not connected"):
            ea.write(7, [(0, 0, 8)])
    finally:
        ea.close()
        eb.close()


def test_unknown_transfer_kind_lists_the_valid_ones(pools: tuple[BufferPool, BufferPool]) -> None:
    a, _ = pools
    with pytest.raises(TransferError, match="valid: auto, nixl, shm"):
        make_transfer_engine("rdma", 0, a.name, a.view)


def test_pool_alloc_blocks_until_slots_are_freed(pools: tuple[BufferPool, BufferPool]) -> None:
    a, _ = pools
    held = a.alloc(4)
    assert a.num_free == 0
    got: list[list[int]] = []
    waiter = threading.Thread(target=lambda: got.append(a.alloc(2)))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and not got  # backpressure: no slot is free
    a.free(held[:2])
    waiter.join(timeout=10)
    assert not waiter.is_alive() and sorted(got[0]) == sorted(held[:2])
    assert a.num_waits == 1 and a.peak_used == 4


def test_pool_refuses_impossible_and_double_frees(pools: tuple[BufferPool, BufferPool]) -> None:
    a, _ = pools
    with pytest.raises(BufferFullError, match="5 slots requested, pool holds 4"):
        a.alloc(5)
    slots = a.alloc(4)
    with pytest.raises(BufferFullError, match="not free within"):
        a.alloc(1, timeout_s=0.01)
    a.free(slots)
    with pytest.raises(BufferFullError, match="freed twice"):
        a.free(slots[:1])
