"""What a simulation returns: per-request records (numpy arrays), the JCT, TTFT breakdown,
latency percentiles, per-resource utilization and the paper's balance metrics."""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
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
    snic_window_series: tuple[float, ...]
    """Per `utilization_bin_s` window: Max/Avg across machines of the bytes their storage NICs
    read in it (paper Fig. 13); NaN in windows where no machine read."""
    snic_window_max_over_avg: float
    """Mean of `snic_window_series` over the windows where some machine read (paper Fig. 13:
    1.53 round robin -> 1.18 DualPath)."""
    attention_bin_s: float
    attention_series: tuple[float, ...]
    """Per `attention_bin_s` bin of step start times: the mean over synchronized prefill steps
    of Max/Avg attention time across the group's engines that ran in the step (engines with
    no work in it excluded; paper Fig. 14); NaN in bins without such steps."""
    attention_ran_max_over_avg: float
    """That Max/Avg averaged over every synchronized prefill step of the run (1.0 when the
    run had none: no synchronized group, or measured step costs)."""
    attention_ran_max_over_avg_first5: float
    """The same over the steps started in the first 5% of the run's duration (to the bin;
    the paper: as low as 1.06 there with DualPath)."""
    attention_engines_ran_mean: float
    """Engines that ran per synchronized step, on average (0 when none)."""
    buffer_peak_bytes_by_node: tuple[float, ...]
    prefill_busy_share: float
    """Share of the run its prefill groups (an expert-parallel node, or one engine) spent in
    a step, their mean: what is left is a prefill side waiting for work (reads, requests)."""
    prefill_compute_share: float
    """Share of the run its prefill groups spent computing (forward passes), their mean; the
    rest of a busy share is a step waiting for its KV to stream (layerwise) or load."""
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
            "snic_window_max_over_avg": self.snic_window_max_over_avg,
            "attention_ran_max_over_avg": self.attention_ran_max_over_avg,
            "attention_ran_max_over_avg_first5": self.attention_ran_max_over_avg_first5,
            "attention_engines_ran_mean": self.attention_engines_ran_mean,
            "prefill_busy_share": self.prefill_busy_share,
            "prefill_compute_share": self.prefill_compute_share,
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


FIRST_FRACTION = 0.05
"""The early part of a run that paper Fig. 14 reports on: its first 5%."""


def window_max_over_avg(bytes_by_machine: Sequence[Sequence[float]] | FloatArray) -> FloatArray:
    """Per time window (the inner index): the largest machine's bytes over the machines' mean
    bytes in that window (paper Fig. 13's Max/Avg); NaN where no machine moved a byte."""
    a = np.asarray(bytes_by_machine, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
        return np.zeros(0)
    mean = a.mean(axis=0)
    out = np.full(a.shape[1], np.nan)
    busy = mean > 0.0
    out[busy] = a.max(axis=0)[busy] / mean[busy]
    return out


def mean_finite(x: FloatArray, empty: float = 1.0,
                weights: FloatArray | None = None) -> float:
    """Mean of the non-NaN entries, optionally weighted (`empty` when there are none)."""
    keep = ~np.isnan(x)
    if not keep.any():
        return empty
    if weights is None:
        return float(np.mean(x[keep]))
    w = np.asarray(weights, dtype=np.float64)[keep]
    return float(np.sum(x[keep] * w) / np.sum(w)) if np.sum(w) > 0 else empty


def binned_step_balance(ratio_sums: Sequence[float], steps: Sequence[int], bin_s: float,
                        duration_s: float) -> tuple[FloatArray, float, float]:
    """From per-bin sums of the steps' Max/Avg and per-bin step counts: the mean per bin (NaN
    where no step), the mean over every step, and the mean over the steps of the bins that
    start within the first `FIRST_FRACTION` of `duration_s` (at least the first bin)."""
    sums = np.asarray(ratio_sums, dtype=np.float64)
    n = np.asarray(steps, dtype=np.float64)
    series = np.full(len(sums), np.nan)
    series[n > 0] = sums[n > 0] / n[n > 0]
    total = float(sums.sum() / n.sum()) if n.sum() > 0 else 1.0
    k = max(1, math.ceil(FIRST_FRACTION * duration_s / bin_s))
    early = float(sums[:k].sum() / n[:k].sum()) if n[:k].sum() > 0 else 1.0
    return series, total, early


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
    read_series = tuple(tuple(n.snic_read.utilization_series(duration)) for n in cluster.nodes)
    snic_windows = window_max_over_avg(
        [[u * n.snic_read.capacity_bytes_per_s * bin_s for u in series]
         for n, series in zip(cluster.nodes, read_series, strict=True)])
    attn_series, attn_all, attn_first = binned_step_balance(
        handlers.attn_bin_ratio, handlers.attn_bin_steps, handlers.attn_bin_s, duration)
    attn_steps = sum(handlers.attn_bin_steps)
    group_s = len(cluster.pgroups) * now
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
        storage_read_series_by_node=read_series,
        snic_window_series=tuple(float(v) for v in snic_windows),
        snic_window_max_over_avg=mean_finite(snic_windows),
        attention_bin_s=handlers.attn_bin_s,
        attention_series=tuple(float(v) for v in attn_series),
        attention_ran_max_over_avg=attn_all,
        attention_ran_max_over_avg_first5=attn_first,
        attention_engines_ran_mean=(handlers.attn_engines_ran / attn_steps if attn_steps
                                    else 0.0),
        buffer_peak_bytes_by_node=tuple(n.buffer_peak_bytes for n in cluster.nodes),
        prefill_busy_share=handlers.prefill_busy_s / group_s if group_s > 0 else 0.0,
        prefill_compute_share=handlers.prefill_compute_s / group_s if group_s > 0 else 0.0,
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
