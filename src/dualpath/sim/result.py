"""What a simulation returns: per-request records (numpy arrays), the JCT, TTFT breakdown,
latency percentiles, per-resource utilization and the paper's balance metrics."""

from __future__ import annotations

import csv
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from dualpath.sched.mode import Mode
    from dualpath.sim.config import SimConfig
    from dualpath.sim.flows import FlowNet, Link
    from dualpath.sim.handlers import Handlers
    from dualpath.sim.kernel import EventLoop
    from dualpath.sim.topology import Cluster

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

RECORD_FIELDS = (
    "request_id", "agent", "row", "prompt_tokens", "hit_tokens", "gen_tokens",
    "pe_engine", "de_engine", "pe_read_tokens", "de_read_tokens",
    "arrive_s", "de_assigned_s", "pe_assigned_s", "read_done_s", "prefill_start_s",
    "prefill_done_s", "decode_join_s", "second_token_s", "done_s",
)


@dataclass(frozen=True)
class ResourceUsage:
    """One kind of link (e.g. `snic_read`, `de_cnic_write`) over all its instances."""

    kind: str
    num_links: int
    capacity_bytes_per_s: float
    """Per link (the nominal capacity; the compute-NIC KV class may have had less)."""
    bytes_carried: float
    """All links of this kind together."""
    mean_utilization: float
    """Average over links of bytes / (capacity * duration)."""
    max_link_utilization: float
    """The busiest single link's average utilization over the run."""
    peak_utilization: float
    """The highest instantaneous load / capacity any link of this kind reached."""
    series: tuple[float, ...]
    """Mean utilization over links per time bin of `SimResult.utilization_bin_s`."""


@dataclass(frozen=True)
class SimResult:
    """The outcome of one `simulate` call. Times are simulated seconds.

    `records` holds one array per field of `RECORD_FIELDS`, one row per request (turn) that
    arrived; not-yet-reached times are -1 (online runs stop with requests in flight).
    """

    mode: str
    cluster: str
    duration_s: float
    jct_s: float
    """Offline: when the last turn finished. Other drivers: the same (last completion)."""
    num_requests: int
    num_completed: int
    stop_reason: str
    records: Mapping[str, npt.NDArray[Any]]
    resources: Mapping[str, ResourceUsage]
    utilization_bin_s: float
    storage_read_bytes_by_node: tuple[float, ...]
    storage_read_series_by_node: tuple[tuple[float, ...], ...]
    """Storage-NIC read utilization of every node per time bin (paper Fig. 13's traffic)."""
    storage_nic_max_over_avg: float
    """Max/Avg of bytes read over every node's storage NIC (paper Fig. 13: 1.53 -> 1.18)."""
    attention_max_over_avg: float
    """Mean over synchronized prefill steps of max/avg attention time in the group (Fig. 14)."""
    attention_max_over_avg_first5: float
    """The same over the first 5% of the steps (the paper reports 1.06 there)."""
    buffer_peak_bytes_by_node: tuple[float, ...]
    num_prefill_steps: int
    num_events: int
    num_flow_recomputes: int
    extra: Mapping[str, float] = field(default_factory=dict)

    # -- derived metrics ------------------------------------------------------------------
    def col(self, name: str) -> FloatArray:
        """One record column as float64 (ids and token counts convert exactly)."""
        return np.asarray(self.records[name], dtype=np.float64)

    def _done(self) -> npt.NDArray[np.bool_]:
        return self.col("done_s") >= 0

    @property
    def ttft_s(self) -> FloatArray:
        """Arrival to first token (end of prefill) of every request that got it."""
        m = self.col("prefill_done_s") >= 0
        return self.col("prefill_done_s")[m] - self.col("arrive_s")[m]

    @property
    def ttst_s(self) -> FloatArray:
        """First to second token (PD hand-off, copy-in and one decode step)."""
        m = self.col("second_token_s") >= 0
        return self.col("second_token_s")[m] - self.col("prefill_done_s")[m]

    @property
    def tpot_s(self) -> FloatArray:
        """Mean time per output token after the second, of completed requests with gen > 2."""
        gen = self.col("gen_tokens")
        m = self._done() & (gen > 2)
        return (self.col("done_s")[m] - self.col("second_token_s")[m]) / (gen[m] - 2)

    def ttft_breakdown_s(self) -> dict[str, float]:
        """Mean TTFT parts of completed prefills: scheduling/queue (arrival to PE assignment,
        minus HBM allocation), allocation (waiting for a DE's HBM), read (queue + storage read),
        prefill (waiting for and running forward passes)."""
        m = self.col("prefill_done_s") >= 0
        if not m.any():
            return {"queue": 0.0, "allocation": 0.0, "read": 0.0, "prefill": 0.0}
        arr = self.col("arrive_s")[m]
        de_t = self.col("de_assigned_s")[m]
        pe_t = self.col("pe_assigned_s")[m]
        rd = self.col("read_done_s")[m]
        pf = self.col("prefill_done_s")[m]
        return {
            "allocation": float(np.mean(de_t - arr)),
            "queue": float(np.mean(pe_t - de_t)),
            "read": float(np.mean(rd - pe_t)),
            "prefill": float(np.mean(pf - rd)),
        }

    def trajectory_jct_s(self) -> FloatArray:
        """Per agent whose every turn completed: first arrival to last completion."""
        agent = self.col("agent").astype(np.int64)
        done = self.col("done_s")
        arr = self.col("arrive_s")
        if not len(agent):
            return np.zeros(0)
        n = int(agent.max()) + 1
        first = np.full(n, np.inf)
        last = np.full(n, -np.inf)
        np.minimum.at(first, agent, arr)
        np.maximum.at(last, agent, done)
        incomplete = np.zeros(n, dtype=bool)
        np.logical_or.at(incomplete, agent, done < 0)
        out: FloatArray = (last - first)[~incomplete]
        return out

    def percentiles(
        self, values: FloatArray, qs: tuple[float, ...] = (50, 90, 99)
    ) -> dict[str, float]:
        """`p50`, `p90`, ... of `values` (zeros when empty)."""
        if not len(values):
            return {f"p{q:g}": 0.0 for q in qs}
        return {f"p{q:g}": float(np.percentile(values, q)) for q in qs}

    def summary(self) -> dict[str, object]:
        """JSON-ready summary (no per-request rows)."""
        return {
            "mode": self.mode,
            "cluster": self.cluster,
            "jct_s": self.jct_s,
            "duration_s": self.duration_s,
            "num_requests": self.num_requests,
            "num_completed": self.num_completed,
            "stop_reason": self.stop_reason,
            "ttft_s": {"mean": _mean(self.ttft_s), **self.percentiles(self.ttft_s)},
            "ttst_s": {"mean": _mean(self.ttst_s), **self.percentiles(self.ttst_s)},
            "tpot_s": {"mean": _mean(self.tpot_s), **self.percentiles(self.tpot_s)},
            "ttft_breakdown_s": self.ttft_breakdown_s(),
            "storage_nic_max_over_avg": self.storage_nic_max_over_avg,
            "attention_max_over_avg": self.attention_max_over_avg,
            "attention_max_over_avg_first5": self.attention_max_over_avg_first5,
            "resources": {
                k: {
                    "num_links": u.num_links,
                    "capacity_bytes_per_s": u.capacity_bytes_per_s,
                    "bytes_carried": u.bytes_carried,
                    "mean_utilization": u.mean_utilization,
                    "max_link_utilization": u.max_link_utilization,
                    "peak_utilization": u.peak_utilization,
                }
                for k, u in self.resources.items()
            },
            "num_prefill_steps": self.num_prefill_steps,
            "num_events": self.num_events,
            **dict(self.extra),
        }

    def write_csv(self, out: TextIO | str | Path) -> None:
        """One row per request, columns `RECORD_FIELDS`."""
        if isinstance(out, str | Path):
            with open(out, "w", newline="", encoding="utf-8") as f:
                self.write_csv(f)
            return
        w = csv.writer(out)
        w.writerow(RECORD_FIELDS)
        cols = [np.asarray(self.records[k]).tolist() for k in RECORD_FIELDS]
        for row in zip(*cols, strict=True):
            w.writerow([f"{v:.6f}" if isinstance(v, float) else v for v in row])


def _mean(x: FloatArray) -> float:
    return float(np.mean(x)) if len(x) else 0.0


def build_result(config: SimConfig, cluster: Cluster, handlers: Handlers, loop: EventLoop,
                 net: FlowNet, stop_reason: str) -> SimResult:
    """Collect a finished run (a `simulator.Simulator`'s parts: this module does not import
    it back) into a `SimResult`, closing every link's accounting."""
    now = loop.now_s
    reqs = handlers.reqs
    for link in cluster.links:
        link.close_segment(now)
    ints = {
        "request_id": [r.request_id for r in reqs], "agent": [r.agent for r in reqs],
        "row": [r.row for r in reqs], "prompt_tokens": [r.prompt_tokens for r in reqs],
        "hit_tokens": [r.hit_tokens for r in reqs], "gen_tokens": [r.gen_tokens for r in reqs],
        "pe_engine": [r.pe_engine for r in reqs], "de_engine": [r.de_engine for r in reqs],
        "pe_read_tokens": [r.pe_read_tokens for r in reqs],
        "de_read_tokens": [r.de_read_tokens for r in reqs],
    }
    floats = {
        "arrive_s": [r.arrived_at for r in reqs],
        "de_assigned_s": [r.de_assigned_at for r in reqs],
        "pe_assigned_s": [r.pe_assigned_at for r in reqs],
        "read_done_s": [r.read_done_at for r in reqs],
        "prefill_start_s": [r.prefill_started_at for r in reqs],
        "prefill_done_s": [r.prefill_done_at for r in reqs],
        "decode_join_s": [r.decode_joined_at for r in reqs],
        "second_token_s": [r.second_token_at for r in reqs],
        "done_s": [r.done_at for r in reqs],
    }
    records: dict[str, npt.NDArray[Any]] = {
        k: np.asarray(v, dtype=np.int64) for k, v in ints.items()
    }
    records.update({k: np.asarray(v, dtype=np.float64) for k, v in floats.items()})
    done = records["done_s"]
    jct = float(done.max()) if len(done) and (done >= 0).all() else now
    duration = max(now, 1e-12)
    by_kind: dict[str, list[Link]] = {}
    for link in cluster.links:
        by_kind.setdefault(link.kind, []).append(link)
    resources: dict[str, ResourceUsage] = {}
    bin_s = config.params.utilization_bin_s
    cnic = cluster.cnic_bytes_per_s
    for kind, links in by_kind.items():
        cap = _nominal(cnic, kind, links[0].capacity_bytes_per_s)
        utils = [lk.bytes_carried / (_nominal(cnic, kind, lk.capacity_bytes_per_s) * duration)
                 for lk in links]
        series_all = [lk.utilization_series(duration) for lk in links]
        series = tuple(float(np.mean(col)) for col in zip(*series_all, strict=True))
        resources[kind] = ResourceUsage(
            kind, len(links), cap, sum(lk.bytes_carried for lk in links),
            float(np.mean(utils)), float(max(utils)), max(lk.peak_utilization for lk in links),
            series,
        )
    read_bytes = tuple(float(n.read_tokens_total * cluster.kv_bpt) for n in cluster.nodes)
    mean_read = sum(read_bytes) / len(read_bytes)
    snic_ratio = max(read_bytes) / mean_read if mean_read > 0 else 1.0
    ratios = handlers.attn_ratio_first
    first = ratios[: max(1, len(ratios) // 20)] if ratios else []
    return SimResult(
        mode=_mode_name(config.mode),
        cluster=config.cluster.label,
        duration_s=now,
        jct_s=jct,
        num_requests=len(reqs),
        num_completed=int((done >= 0).sum()),
        stop_reason=stop_reason or (
            "completed" if all(r.done_at >= 0.0 for r in reqs) else "stalled"
        ),
        records=records,
        resources=resources,
        utilization_bin_s=bin_s,
        storage_read_bytes_by_node=read_bytes,
        storage_read_series_by_node=tuple(
            tuple(n.snic_read.utilization_series(duration)) for n in cluster.nodes
        ),
        storage_nic_max_over_avg=snic_ratio,
        attention_max_over_avg=(handlers.attn_ratio_sum / handlers.attn_ratio_steps
                                if handlers.attn_ratio_steps else 1.0),
        attention_max_over_avg_first5=(sum(first) / len(first) if first else 1.0),
        buffer_peak_bytes_by_node=tuple(n.buffer_peak_bytes for n in cluster.nodes),
        num_prefill_steps=handlers.num_prefill_steps,
        num_events=loop.num_events,
        num_flow_recomputes=net.num_recomputes,
    )


def _nominal(cnic_bytes_per_s: float, kind: str, cap: float) -> float:
    # Compute-NIC capacities drop while inference traffic holds the high-priority class;
    # utilization is reported against the nominal (full) capacity.
    if kind.endswith(("cnic_read", "cnic_write")):
        return cnic_bytes_per_s
    return cap


def _mode_name(m: Mode) -> str:
    from dualpath.sim.config import MODE_PRESETS

    for name, mode in MODE_PRESETS.items():
        if mode == m:
            return name
    return f"layerwise={m.is_layerwise},paths={m.paths},scheduler={m.scheduler},io={m.io}"
