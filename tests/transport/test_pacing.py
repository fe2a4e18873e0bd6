"""The token-bucket pacer: FIFO over callers at the rate, booked before the real I/O so the
two overlap, unlimited rates counted but never waited for."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from dualpath.core.errors import SpecError
from dualpath.transport.pacing import UNLIMITED, Pacer, sleep_until


def test_charges_hold_bytes_to_the_rate() -> None:
    pacer = Pacer.from_gbps(0.08, "storage_read")  # 10 MB/s
    t0 = time.monotonic()
    for _ in range(4):
        pacer.charge(250_000)  # 4 x 25 ms
    assert time.monotonic() - t0 >= 0.095
    assert pacer.num_bytes == 1_000_000
    assert pacer.busy_s == pytest.approx(0.1)


def test_bookings_queue_back_to_back_whatever_the_reads_between_them_cost() -> None:
    """`reading` books the NIC first: bookings follow each other at the NIC's rate."""
    pacer = Pacer.from_gbps(0.08, "storage_read")  # 100_000 B take 10 ms
    first = pacer.book(100_000)
    second = pacer.book(100_000)
    assert second - first == pytest.approx(0.01)
    with pacer.reading(100_000):
        pass
    assert time.monotonic() >= second + 0.01 - 1e-6
    assert pacer.busy_s == pytest.approx(0.03)
    assert pacer.ahead_s(second + 0.01) == pytest.approx(0.0, abs=1e-9)


def test_an_idle_pacer_starts_from_now_not_from_its_last_booking() -> None:
    pacer = Pacer(1e6)
    done = pacer.book(1000, now=100.0)
    assert done == pytest.approx(100.001)
    assert pacer.book(1000, now=200.0) == pytest.approx(200.001)  # no credit for idle time
    assert pacer.ahead_s(200.0) == pytest.approx(0.001)


def test_threads_share_one_fifo() -> None:
    pacer = Pacer(10e6)
    finishes: list[float] = []
    lock = threading.Lock()

    def read() -> None:
        done = pacer.book(100_000)
        with lock:
            finishes.append(done)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    finishes.sort()
    gaps = [b - a for a, b in itertools.pairwise(finishes)]
    assert all(g == pytest.approx(0.01) for g in gaps)  # no two bookings overlap


def test_unlimited_rate_counts_without_waiting() -> None:
    pacer = Pacer(UNLIMITED, "oracle")
    assert pacer.is_unlimited
    t0 = time.monotonic()
    assert pacer.charge(10**12) == 0.0
    assert time.monotonic() - t0 < 0.5
    assert pacer.num_bytes == 10**12 and pacer.busy_s == 0.0


def test_bad_rates_are_refused_by_name() -> None:
    with pytest.raises(SpecError, match="storage_read_gbps=0"):
        Pacer.from_gbps(0, "storage_read")
    with pytest.raises(SpecError, match=r"pacer\[p\]\.rate_bytes_per_s"):
        Pacer(-1.0, "p")


def test_sleep_until_a_past_time_returns_at_once() -> None:
    assert sleep_until(time.monotonic() - 1) == 0.0
