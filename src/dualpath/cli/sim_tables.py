"""`dualpath simulate`'s tables: one row per mode, read the same way for every row.

Offline runs compare job completion times (JCT) against basic, and only between runs that all
completed. Online runs have no JCT to compare: each row says why and when the run stopped, how
many turns it completed, and its latencies against the SLO (advise's: mean TTFT <= 4 s, mean
TPOT <= 50 ms).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from dualpath.plan.capacity import TPOT_SLO_S, TTFT_SLO_S
from dualpath.sim import SimResult

STOP_WORDS = {
    "completed": "completed",
    "stalled": "stalled (turns left that nothing could run)",
    "ttft_limit": "overloaded: a turn's TTFT passed the limit",
    "steady_state": "steady: mean TTFT settled",
    "max_duration": "ran its full --max-duration",
}

SHARES_EPILOG = (
    "SNIC util = mean storage-NIC read utilization; PE busy / PE comp = share of the run the "
    "prefill groups spent in a step / computing (a busy share well above the compute share is "
    "a prefill side waiting for its KV to stream; a low busy share, one waiting for reads or "
    "requests); SNIC M/A = storage-NIC traffic Max/Avg across machines per 10 s window (paper "
    "Fig. 13); attn M/A = attention-time Max/Avg across the engines that ran in a synchronized "
    "prefill step (Fig. 14)."
)


def _stat(values: npt.NDArray[np.float64], scale: float = 1.0) -> tuple[float, float]:
    if not len(values):
        return float("nan"), float("nan")
    return float(np.mean(values)) * scale, float(np.percentile(values, 99)) * scale


def _shares(r: SimResult) -> str:
    return (f"{r.resources['snic_read'].mean_utilization:>9.1%} {r.prefill_busy_share:>8.1%} "
            f"{r.prefill_compute_share:>8.1%} {r.snic_window_max_over_avg:>9.2f} "
            f"{r.attention_ran_max_over_avg:>9.2f}")


SHARES_HEAD = f"{'SNIC util':>9} {'PE busy':>8} {'PE comp':>8} {'SNIC M/A':>9} {'attn M/A':>9}"


def render_offline(results: dict[str, SimResult], workload: str) -> str:
    """Offline (or replay) runs: JCT, and the speedup over basic where both completed."""
    first = next(iter(results.values()))
    lines = [f"cluster {first.cluster}, {workload}"]
    lines.append(f"  {'mode':<10} {'turns done':>11} {'JCT s':>10} {'vs basic':>9} "
                 f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT ms':>8} {SHARES_HEAD}")
    base = results.get("basic")
    for name, r in results.items():
        comparable = (base is not None and r.stop_reason == base.stop_reason == "completed"
                      and r.jct_s > 0)
        speed = f"{base.jct_s / r.jct_s:.2f}x" if comparable and base else "-"
        ttft = r.percentiles(r.ttft_s)
        tpot = r.tpot_s
        done = f"{r.num_completed:,}" + ("" if r.stop_reason == "completed" else " !")
        lines.append(
            f"  {name:<10} {done:>11} {r.jct_s:>10.1f} {speed:>9} {ttft['p50']:>9.2f} "
            f"{ttft['p99']:>9.2f} {(tpot.mean() * 1e3 if len(tpot) else 0.0):>8.1f} "
            f"{_shares(r)}")
    for name, r in results.items():
        if r.stop_reason != "completed":
            lines.append(f"  ! {name}: {STOP_WORDS.get(r.stop_reason, r.stop_reason)} after "
                         f"{r.duration_s:,.1f} s; its JCT is not comparable")
    return "\n".join(lines)


def _all_agents_done(r: SimResult, num_agents: int) -> bool:
    """Every one of the run's `num_agents` agents arrived and finished all its turns."""
    arrived = len(np.unique(r.records["agent"])) if r.num_requests else 0
    return 0 < num_agents <= arrived and r.num_completed == r.num_requests


def render_online(results: dict[str, SimResult], aps: float, max_duration_s: float,
                  ttft_limit_s: float, num_agents: int = 0) -> str:
    """Online runs: why each stopped, its completed turns and latencies against the SLO."""
    first = next(iter(results.values()))
    lines = [
        f"cluster {first.cluster}, online: {aps:g} agents/s (APS) arriving for up to "
        f"{max_duration_s:,.0f} simulated s; a run stops early once a turn's TTFT passes "
        f"{ttft_limit_s:g} s",
        f"  SLO: mean TTFT <= {TTFT_SLO_S:g} s and mean TPOT <= {TPOT_SLO_S * 1e3:g} ms over the "
        "turns that got them (a run stopped on overload fails)",
        f"  {'mode':<10} {'APS':>6} {'stopped after':>14} {'turns done':>11} "
        f"{'TTFT mean s':>11} {'p99':>7} {'TPOT mean ms':>12} {'p99':>7} {'SLO':>5}  stop reason",
    ]
    for name, r in results.items():
        why = STOP_WORDS.get(r.stop_reason, r.stop_reason)
        if r.stop_reason == "max_duration" and _all_agents_done(r, num_agents):
            why = f"all {num_agents} agents (--agents) arrived and finished"
        ttft_mean, ttft_p99 = _stat(r.ttft_s)
        tpot_mean, tpot_p99 = _stat(r.tpot_s, 1e3)
        meets = (r.stop_reason != "ttft_limit" and ttft_mean <= TTFT_SLO_S
                 and tpot_mean <= TPOT_SLO_S * 1e3)
        lines.append(
            f"  {name:<10} {aps:>6g} {r.duration_s:>12,.1f} s {r.num_completed:>11,} "
            f"{ttft_mean:>11.2f} {ttft_p99:>7.2f} {tpot_mean:>12.1f} {tpot_p99:>7.1f} "
            f"{'met' if meets else 'FAIL':>5}  {why}")
    lines.append(f"  {'mode':<10} {SHARES_HEAD}")
    lines += [f"  {name:<10} {_shares(r)}" for name, r in results.items()]
    return "\n".join(lines)
