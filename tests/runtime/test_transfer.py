"""The runtime's transfer engines (shared memory, NIXL when installed) between two nodes'
slot pools (the pool itself: tests/transport/test_slots.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from dualpath.runtime.transfer import make_transfer_engine
from dualpath.transport.nixl import is_nixl_available
from dualpath.transport.slots import SlotPool
from dualpath.transport.transfer_error import TransferError


@pytest.fixture
def pools() -> Iterator[tuple[SlotPool, SlotPool]]:
    tag = uuid.uuid4().hex[:8]
    a = SlotPool(f"dpt{tag}a", 4096, 4)
    b = SlotPool(f"dpt{tag}b", 4096, 4)
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
    pools: tuple[SlotPool, SlotPool], kind: str
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


def test_unknown_transfer_kind_lists_the_valid_ones(pools: tuple[SlotPool, SlotPool]) -> None:
    a, _ = pools
    with pytest.raises(TransferError, match="valid: auto, nixl, shm"):
        make_transfer_engine("rdma", 0, a.name, a.view)
