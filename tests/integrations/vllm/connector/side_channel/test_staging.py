"""The staging pool holds a transfer's slots until it is released (or idle past its TTL):
a full pool refuses, and no slot with bytes in flight is ever handed to another transfer."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pytest

from dualpath.integrations.vllm.connector.side_channel.staging import StagingPool
from dualpath.integrations.vllm.connector.side_channel.wire import SideChannelError
from dualpath.transport.nixl import WAIT_TIMEOUT_S
from dualpath.transport.slots import SlotPool
from dualpath.transport.transfer_error import BufferFullError


@pytest.fixture
def pool() -> Iterator[StagingPool]:
    p = StagingPool(SlotPool(None, 64, 3), ttl_s=3600)
    yield p
    p.close()


def test_a_full_pool_refuses_instead_of_taking_slots_in_flight(pool: StagingPool) -> None:
    a = pool.alloc("a", [0, 1])  # a prefill's WRITE into these may be in flight
    pool.alloc("b", [0])
    with pytest.raises(BufferFullError, match="full"):
        pool.alloc("c", [0, 1])  # the old pool freed "a" (the oldest) for it
    assert pool.num_expired == 0
    pool.commit("a")
    assert pool.lookup("a", [0, 1]) == a  # still a's, bytes and all
    assert pool.alloc("a", [1, 0]) == [a[1], a[0]]  # a block asked twice keeps its slot
    pool.release("a")
    assert sorted(pool.alloc("c", [0, 1])) == sorted(a)
    with pytest.raises(BufferFullError):
        pool.alloc("d", [0, 1, 2, 3])  # more than the pool holds
    assert pool.num_free == 0


def test_a_release_during_a_store_read_waits_for_the_read(pool: StagingPool) -> None:
    pool.alloc("s", [0, 1, 2], is_read=True)  # the store is reading into them
    pool.release("s")  # the decode side gave up on the request meanwhile
    assert pool.num_free == 0
    with pytest.raises(BufferFullError):
        pool.alloc("t", [0])
    assert pool.lookup("s", [0]) == [None]
    with pytest.raises(SideChannelError, match="released while staging"):
        pool.mark_staged("s", [0, 1, 2])  # the read ends: now the slots go back
    assert pool.num_free == 3
    with pytest.raises(SideChannelError, match="released while staging"):
        pool.mark_staged("s", [0])


def test_only_idle_transfers_expire(pool: StagingPool) -> None:
    pool.alloc("idle", [0])
    pool.alloc("reading", [0], is_read=True)
    now = time.monotonic()
    assert pool.expire_idle(now + pool.ttl_s - 1) == 0
    assert pool.expire_idle(now + pool.ttl_s + 1) == 1  # not the one being read into
    assert pool.num_free == 2 and pool.num_expired == 1
    pool.mark_staged("reading", [0])
    assert pool.lookup("reading", [0]) != [None]
    with pytest.raises(ValueError, match="NIXL wait timeout"):
        StagingPool(pool.slots, ttl_s=WAIT_TIMEOUT_S)


def test_no_slot_is_ever_shared_by_two_live_transfers() -> None:
    """Threads allocate, fill their slots with their own mark, hold them a moment (a transfer
    in flight), check that nobody wrote over them, and release; the pool is often full."""
    pool = StagingPool(SlotPool(None, 64, 8), ttl_s=3600)
    errors: list[str] = []
    refused = [0]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for i in range(60):
            xfer = f"w{seed}-{i}"
            try:
                slots = pool.alloc(xfer, list(range(rng.randint(1, 4))))
            except BufferFullError:
                refused[0] += 1
                continue
            for s in slots:
                pool.view(s).fill_(seed)
            time.sleep(rng.random() * 0.002)
            for s in slots:
                if not bool((pool.view(s) == seed).all()):
                    errors.append(f"slot {s} of {xfer} was overwritten")
            pool.release(xfer)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(1, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert refused[0] > 0  # the pool was full at times
    assert pool.num_free == 8
    pool.close()
