"""The connector in vLLM's own telemetry (`connector.vllm_metrics`): its stats through vLLM's
stats types and Prometheus classes, its KV events through vLLM's event batch encoding (what
its ZMQ publisher sends). Needs vllm: runs in `.venv-vllm` (`make vllm-test`), skipped in
`.venv`; the live check (a ZMQ subscriber, the instances' /metrics) is in the P/D test."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from dualpath.integrations.vllm.connector.dualpath_connector import DualPathConnector
from dualpath.integrations.vllm.connector.vllm_metrics import (
    DualPathPromMetrics,
    DualPathStats,
    storage_events,
)


def test_stats_add_up_across_workers_and_steps_and_reset_when_taken() -> None:
    a = DualPathStats()
    assert a.is_empty()
    a.add(loaded_blocks_pe=2, loaded_bytes_pe=20, recomputed_blocks=1)
    a.set_queue({"pe": 3, "de": 0})
    b = DualPathStats()
    b.add(loaded_blocks_de=4, saved_blocks=5)
    taken = a.take()
    assert a.is_empty() and not taken.is_empty()
    total = taken.aggregate(b)
    assert isinstance(total, DualPathStats)
    assert total.data["loaded_blocks_pe"] == 2 and total.data["loaded_blocks_de"] == 4
    assert total.data["read_queue_blocks_pe"] == 3 and total.data["saved_blocks"] == 5
    assert total.reduce()["Recomputed blocks"] == 1
    # vLLM rebuilds worker stats from their data (`build_kv_connector_stats`).
    again = DualPathConnector.build_kv_connector_stats(total.data)
    assert isinstance(again, DualPathStats) and again.data == total.data


def test_prometheus_metrics_have_vllm_names_and_the_read_path() -> None:
    registry = CollectorRegistry()

    def bound(cls: type[Any]) -> type[Any]:
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **k: cls.__init__(
            self, *a, registry=registry, **k)})

    types: dict[type[Any], type[Any]] = {Counter: bound(Counter), Gauge: bound(Gauge),
                                         Histogram: bound(Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)  # all the base class reads of it
    prom = DualPathConnector.build_prom_metrics(
        config, types, ["model_name", "engine"], {0: ["m", "0"]})  # type: ignore[arg-type]
    assert isinstance(prom, DualPathPromMetrics)
    step = DualPathStats()
    step.add(loaded_blocks_pe=3, loaded_blocks_de=1, load_errors=2, saved_blocks=7)
    step.set_queue({"pe": 4, "de": 1})
    prom.observe(step.data, 0)
    prom.observe(step.data, 0)
    text = generate_latest(registry).decode()
    assert 'vllm:dualpath_loaded_blocks_total{engine="0",model_name="m",read_path="pe"} 6.0' \
        in text
    assert 'vllm:dualpath_loaded_blocks_total{engine="0",model_name="m",read_path="de"} 2.0' \
        in text
    assert 'vllm:dualpath_load_errors_total{engine="0",model_name="m"} 4.0' in text
    assert 'vllm:dualpath_saved_blocks_total{engine="0",model_name="m"} 14.0' in text
    assert 'vllm:dualpath_read_queue_blocks{engine="0",model_name="m",read_path="pe"} 4.0' \
        in text


def test_storage_events_travel_in_vllms_event_batches() -> None:
    h = [b"\x01" * 32, b"\x02" * 32, b"\x03" * 32]
    events = storage_events([(h[1:], h[0], list(range(8)))], [h[2]], block_size=4)
    stored, removed = events
    assert isinstance(stored, BlockStored) and stored.medium == "STORAGE"
    assert stored.block_hashes == h[1:] and stored.parent_block_hash == h[0]
    assert isinstance(removed, BlockRemoved) and removed.medium == "STORAGE"
    wire = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=events))
    back = msgspec.msgpack.Decoder(type=KVEventBatch).decode(wire)
    assert [type(e).__name__ for e in back.events] == ["BlockStored", "BlockRemoved"]
    assert back.events[0].medium == "STORAGE" and back.events[0].token_ids == list(range(8))
    assert storage_events([([], None, [])], [], 4) == []
