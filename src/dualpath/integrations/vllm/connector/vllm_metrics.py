"""`DualPathConnector` in vLLM's own telemetry.

- Connector stats: `DualPathStats` (a `KVConnectorStats`), filled by both sides of the
  connector (`get_kv_connector_stats`): the scheduler side counts what the prefill loads gave
  (blocks and bytes per read side, recomputed blocks) and the load errors vLLM was told of;
  each worker its saves, failed saves, side-channel / NIXL errors and the blocks its
  background loads still have queued per read side. vLLM sums them per step, logs them with
  its throughput lines and, through `DualPathPromMetrics`, exports them on the instance's
  `/metrics` as `vllm:dualpath_*` (with vLLM's `model_name` and `engine` labels).
- KV events: `storage_events` turns the blocks a step persists (and those whose load failed)
  into vLLM's `BlockStored` / `BlockRemoved` with `medium="STORAGE"`, keyed by vLLM's own
  block hashes, so vLLM's KV event publisher (ZMQ, `--kv-events-config`) carries them beside
  its GPU ones, for routers that index KV events.

Like `dualpath_connector`, this module imports vllm.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

MEDIUM = "STORAGE"
"""The `medium` of DualPath's KV events: the shared block store, not a GPU or CPU tier."""
SIDES = ("pe", "de")
COUNTERS = {
    "loaded_blocks": "Stored KV blocks a prefill loaded, per read path (pe: this node's "
                     "storage NIC; de: the decode node's, pulled over NIXL).",
    "loaded_bytes": "Bytes of those blocks, per read path.",
    "recomputed_blocks": "Stored KV blocks planned to load that were recomputed (a load "
                         "failed, and every later block of its request).",
    "load_errors": "Blocks whose load failed (missing, corrupt, a side channel or NIXL "
                   "failure); each is recomputed.",
    "saved_blocks": "Full blocks written to the store.",
    "failed_saves": "Blocks that could not be written to the store.",
    "remote_errors": "Side-channel or NIXL failures (each costs a recompute).",
    "unkeyed_requests": "Requests served without the store: their KV depends on inputs the "
                        "connector cannot key safely (prompt embeddings, an unhashed "
                        "multimodal input).",
}
"""Counters (`vllm:dualpath_<name>_total`); `loaded_*` have a `read_path` label."""
GAUGES = {
    "read_queue_blocks": "Blocks of background loads not yet done, per read path (the "
                         "storage read queue of this prefill instance).",
}
"""Gauges (`vllm:dualpath_<name>`), with a `read_path` label."""
_PER_SIDE = {"loaded_blocks", "loaded_bytes", "read_queue_blocks"}


def _keys() -> list[str]:
    return [f"{name}_{side}" if name in _PER_SIDE else name
            for name in COUNTERS for side in (SIDES if name in _PER_SIDE else ("",))]


@dataclass
class DualPathStats(KVConnectorStats):  # type: ignore[misc]
    """One step's (or one interval's) counts: `data` maps `<counter>[_<side>]` to an int and
    `read_queue_blocks_<side>` to the latest depth (absent when not measured)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = dict.fromkeys(_keys(), 0)

    def add(self, **counts: int) -> None:
        """Add to counters (`loaded_blocks_pe=2`, `load_errors=1`, ...)."""
        for key, n in counts.items():
            self.data[key] = self.data.get(key, 0) + int(n)

    def set_queue(self, depths: dict[str, int]) -> None:
        """The read queues' depths now, per side."""
        for side, n in depths.items():
            self.data[f"read_queue_blocks_{side}"] = int(n)

    def take(self) -> DualPathStats:
        """These counts, and this object reset (what a `get_kv_connector_stats` returns)."""
        out = DualPathStats(data=dict(self.data))
        self.reset()
        return out

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Counters add up; queue depths add up across workers (each rank its own reads)."""
        for key, value in other.data.items():
            if isinstance(value, int):
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """What vLLM's periodic log line shows."""
        d = self.data
        return {"Loaded blocks PE": d.get("loaded_blocks_pe", 0),
                "Loaded blocks DE": d.get("loaded_blocks_de", 0),
                "Recomputed blocks": d.get("recomputed_blocks", 0),
                "Load errors": d.get("load_errors", 0),
                "Saved blocks": d.get("saved_blocks", 0)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class DualPathPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """`vllm:dualpath_*` on the instance's `/metrics`, from each step's `DualPathStats`."""

    def __init__(self, vllm_config: VllmConfig,
                 metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                 ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        self._gauges: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            self._make(self._counter_cls, name, doc, self._counters)
        for name, doc in GAUGES.items():
            self._make(self._gauge_cls, name, doc, self._gauges)

    def _make(self, cls: Any, name: str, doc: str, into: dict[str, dict[int, Any]]) -> None:
        if name not in _PER_SIDE:
            into[name] = create_metric_per_engine(
                cls(name=f"vllm:dualpath_{name}", documentation=doc,
                    labelnames=self._labelnames), self.per_engine_labelvalues)
            return
        metric = cls(name=f"vllm:dualpath_{name}", documentation=doc,
                     labelnames=[*self._labelnames, "read_path"])
        for side in SIDES:
            into[f"{name}_{side}"] = {
                idx: metric.labels(*values, side)
                for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._counters.items():
            n = transfer_stats_data.get(key, 0)
            if n:
                per_engine[engine_idx].inc(n)
        for key, per_engine in self._gauges.items():
            if key in transfer_stats_data:
                per_engine[engine_idx].set(transfer_stats_data[key])


def storage_events(stored: Iterable[tuple[Sequence[Any], Any, Sequence[int]]],
                   removed: Sequence[Any], block_size: int) -> list[KVCacheEvent]:
    """vLLM KV events with `medium="STORAGE"`: a `BlockStored` per run of blocks persisted
    (their vLLM block hashes, the hash before them, their token ids) and one `BlockRemoved`
    of the blocks that failed to load (not to be counted on until written again)."""
    events: list[KVCacheEvent] = [
        BlockStored(block_hashes=list(hashes), parent_block_hash=parent,
                    token_ids=list(tokens), block_size=block_size, lora_id=None,
                    medium=MEDIUM, lora_name=None)
        for hashes, parent, tokens in stored if hashes]
    if removed:
        events.append(BlockRemoved(block_hashes=list(removed), medium=MEDIUM))
    return events
