"""Traffic manager: pacing never exceeds a port's rate, 99:1 weighted arbitration, doorbell
batches move real bytes."""

from __future__ import annotations

import itertools
import threading

import pytest

from dualpath.core.errors import SpecError
from dualpath.runtime.traffic import (
    Copy,
    NodeNics,
    Port,
    PortConfig,
    TrafficClass,
    TrafficManager,
    _Request,
)


def test_grants_are_spaced_by_bytes_over_rate() -> None:
    rate, chunk = 100e6, 64 * 1024
    port = Port(PortConfig("p", rate, chunk_bytes=chunk))
    times = [port.grant(chunk) for _ in range(8)]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # The virtual clock advances by chunk/rate per grant: never faster than the port.
    assert all(g >= chunk / rate - 1e-9 for g in gaps)
    assert port.stats.bytes_by_class[TrafficClass.LOW] == 8 * chunk
    assert port.stats.busy_s == pytest.approx(8 * chunk / rate)


def test_weighted_round_robin_is_99_to_1_when_both_backlogged() -> None:
    chunk = 4096
    port = Port(PortConfig("p", 1e9, chunk_bytes=chunk))
    high, low = port._queues
    for _ in range(1000):
        high.append(_Request(chunk, TrafficClass.HIGH))
        low.append(_Request(chunk, TrafficClass.LOW))
    for _ in range(1000):
        port._grant_next(now=0.0)
    granted = port.stats.bytes_by_class
    assert granted[TrafficClass.HIGH] == 990 * chunk
    assert granted[TrafficClass.LOW] == 10 * chunk


def test_low_class_gets_the_whole_port_when_high_is_idle() -> None:
    port = Port(PortConfig("p", 1e9, chunk_bytes=4096))
    low = port._queues[TrafficClass.LOW]
    for _ in range(50):
        low.append(_Request(4096, TrafficClass.LOW))
    for _ in range(50):
        port._grant_next(now=0.0)
    assert port.stats.bytes_by_class == [0, 50 * 4096]


def test_concurrent_senders_share_a_port_and_every_byte_is_charged() -> None:
    port = Port(PortConfig("p", 200e6, chunk_bytes=32 * 1024))
    tm = TrafficManager()
    size = 256 * 1024

    def send(cls: TrafficClass) -> None:
        src, dst = bytearray(b"x" * size), bytearray(size)
        tm.send([port], memoryview(src), memoryview(dst), cls)
        assert dst == src

    threads = [threading.Thread(target=send, args=(c,)) for c in TrafficClass for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert port.stats.bytes_by_class == [2 * size, 2 * size]


def test_doorbell_batch_copies_every_descriptor_once() -> None:
    tx = Port(PortConfig("tx", 1e9))
    rx = Port(PortConfig("rx", 1e9))
    tm = TrafficManager()
    src = bytearray(range(256)) * 16
    dst = bytearray(len(src))
    s, d = memoryview(src), memoryview(dst)
    copies = [Copy(s[i : i + 256], d[i : i + 256]) for i in range(0, len(src), 256)]
    moved = tm.send_batch([tx, rx], copies)
    assert moved == len(src) and dst == src
    assert tm.num_batches == 1 and tm.num_copies == len(copies)
    assert tx.stats.total_bytes == rx.stats.total_bytes == len(src)


def test_mismatched_copy_is_refused() -> None:
    tm = TrafficManager()
    with pytest.raises(SpecError, match="nbytes"):
        tm.send([], memoryview(bytearray(4)), memoryview(bytearray(5)))


def test_unlimited_port_counts_without_pacing() -> None:
    port = Port(PortConfig("oracle", float("inf")))
    assert port.config.is_unlimited
    TrafficManager().charge([port], 10**9)
    assert port.stats.total_bytes == 10**9 and port.stats.busy_s == 0.0


def test_port_config_rejects_bad_rates() -> None:
    with pytest.raises(SpecError, match=r"port\[p\]\.rate_bytes_per_s"):
        PortConfig("p", 0.0)
    with pytest.raises(SpecError, match="chunk_bytes"):
        PortConfig("p", 1.0, chunk_bytes=0)


def test_node_nics_name_every_port() -> None:
    nics = NodeNics.create(3, 2, 1e6, 4e6)
    names = [p.name for p in nics.all_ports()]
    assert names == [
        "n3.snic.read",
        "n3.snic.write",
        "n3.e0.cnic.tx",
        "n3.e1.cnic.tx",
        "n3.e0.cnic.rx",
        "n3.e1.cnic.rx",
    ]
    assert nics.storage_read.config.rate_bytes_per_s == 1e6
    assert nics.compute_tx[1].config.rate_bytes_per_s == 4e6


def test_reservations_hold_the_port_back_to_back() -> None:
    port = Port(PortConfig("snic", 1e6))
    first = port.reserve(100_000)
    second = port.reserve(50_000)
    # The second transfer starts where the first ends: no gap, no overlap.
    assert second - first == pytest.approx(0.05)
    assert port.stats.busy_s == pytest.approx(0.15)
    assert port.stats.total_bytes == 150_000
