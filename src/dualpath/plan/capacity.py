"""Online runs (Poisson agent arrivals, each replaying its trajectory back to back) judged
against the SLO, and the search for a system's SLO capacity that `advise` and the Fig. 10
reproduction share.

SLO (paper §7.2): TTFT <= 4 s and TPOT <= 50 ms, judged at steady state as the paper does (A.4):
the simulator stops an online run once the mean TTFT of the prefills that completed in the last
150 s is within 5% of that of the window 30 minutes earlier (`sim.Driver`), and the point's means
are that last window's. A run that reaches its length without settling fails (its means are its
last window's); a run is aborted, and fails, as soon as one turn waits more than 20 s for its
first token. Full runs may last up to 7,200 simulated seconds (the rule needs 1,950). A run too
short for the rule (the quick runs: 600 s) is judged on the means over turns arriving after its
first third, which flatters a system whose queues still grow.
Capacity is bracketed per system by doubling (while the SLO is met, up to 64x) or halving (while
it fails, down to 1/16) from a guess, then bisected; an open bracket is reported as a bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from dualpath.plan.runner import Runner, RunSpec, run_storage
from dualpath.plan.section import Context
from dualpath.sim import Driver, SimResult

TTFT_SLO_S = 4.0

TPOT_SLO_S = 0.050

STEADY_WINDOW_S = Driver().steady_window_s
"""The simulator's online stop rule (paper A.4): a window of this length (150 s) ..."""

STEADY_LOOKBACK_S = Driver().steady_lookback_s
"""... whose mean TTFT is within 5% of the window this much earlier (30 min) is steady."""

FULL_ONLINE_DURATION_S = 7200.0
"""Simulated seconds of a full-size online run (quick: `QUICK_ONLINE_DURATION_S`)."""

QUICK_ONLINE_DURATION_S = 600.0

APS_GUESS = {"ds27b_1p1d": 0.3, "ds660b_2p4d": 0.3, "qwen32b_1p2d": 0.3}


@dataclass(frozen=True)
class OnlinePoint:
    """Steady-part latency means of one online run."""

    aps: float
    ttft_s: float
    ttst_s: float
    tpot_s: float
    trajectory_jct_s: float
    breakdown_s: dict[str, float]
    stop_reason: str
    steady_at_s: float | None = None
    """When the simulator stopped the run at steady state (the end of the window the means come
    from); NaN: judged and never steady (ended at its length or by the TTFT abort); None: too
    short a run for the rule (means over turns after its first third)."""

    @property
    def is_steady(self) -> bool:
        """Reached steady state (or too short a run to tell: judged as before)."""
        return self.steady_at_s is None or math.isfinite(self.steady_at_s)

    @property
    def meets_slo(self) -> bool:
        return (self.is_steady and self.stop_reason != "ttft_limit"
                and self.ttft_s <= TTFT_SLO_S and self.tpot_s <= TPOT_SLO_S)


def steady_point(r: SimResult, aps: float) -> OnlinePoint:
    """The run's latency means at steady state. A run the simulator stopped at steady state
    (`Driver`'s rule, the paper's) gives the means over its last `STEADY_WINDOW_S`: TTFT of the
    prefills, TTST of the second tokens, TPOT of the turns that finished in it. A run that
    lasted long enough to be judged and never settled gives its last window's, and fails. A
    run too short for the rule (quick) gives the means over turns arriving after its first
    third."""
    arr = r.col("arrive_s")
    pf, sec, done = r.col("prefill_done_s"), r.col("second_token_s"), r.col("done_s")
    gen = r.col("gen_tokens")
    steady_at: float | None = None
    if r.stop_reason == "steady_state" or r.duration_s >= STEADY_LOOKBACK_S + STEADY_WINDOW_S:
        # Each mean over the events of the last window: first tokens (as the stop rule),
        # second tokens, finished turns (a turn's decode outlasts the window it started in).
        steady_at = r.duration_s if r.stop_reason == "steady_state" else math.nan
        lo = r.duration_s - STEADY_WINDOW_S
        m1 = pf >= lo
        m2 = (sec >= lo) & (pf >= 0)
        m3 = (done >= lo) & (sec >= 0) & (gen > 2)
    else:
        late = arr >= r.duration_s / 3.0
        m1 = late & (pf >= 0)
        m2 = late & (sec >= 0)
        m3 = late & (done >= 0) & (gen > 2)
    ttft = float(np.mean(pf[m1] - arr[m1])) if m1.any() else math.inf
    ttst = float(np.mean(sec[m2] - pf[m2])) if m2.any() else math.inf
    tpot = float(np.mean((done[m3] - sec[m3]) / (gen[m3] - 2))) if m3.any() else math.inf
    traj = r.trajectory_jct_s()
    return OnlinePoint(aps, ttft, ttst, tpot, float(np.mean(traj)) if len(traj) else math.nan,
                       r.ttft_breakdown_s(), r.stop_reason, steady_at)


def online_duration_s(ctx: Context) -> float:
    """Simulated seconds of each online run: `--online-duration`, else 600 quick, 7,200 full."""
    return ctx.online_duration_s or (QUICK_ONLINE_DURATION_S if ctx.is_quick
                                     else FULL_ONLINE_DURATION_S)


def _spec(
    ctx: Context, name: str, mode: str, aps: float, pd: tuple[int, int] | None,
    ep: tuple[int, int] = (0, 0),
) -> RunSpec:
    dur = online_duration_s(ctx)
    n = math.ceil(aps * dur * 1.2) + 8
    # Quick runs use the 32K trace: its trajectories live about a third as long, so a 600 s run
    # gets closer to steady state (the full runs use 64K, the paper's likely online set).
    mal = ctx.mals[0] if ctx.mals else ("32k" if ctx.is_quick else "64k")
    p, d = pd or (0, 0)
    storage = None if ctx.storage_read is None else run_storage(ctx.storage_read, name)
    return RunSpec(name, mode, n, mal, aps=aps, max_duration_s=dur, num_prefill_nodes=p,
                   num_decode_nodes=d, ep_engines=ep, storage=storage)


def point_spec(
    ctx: Context, name: str, mode: str, aps: float, pd: tuple[int, int] | None = None,
    ep: tuple[int, int] = (0, 0),
) -> RunSpec:
    """The run of `point` (to prefetch several)."""
    return _spec(ctx, name, mode, round(aps, 4), pd, ep)


def point(
    ctx: Context, name: str, mode: str, aps: float, pd: tuple[int, int] | None = None,
    ep: tuple[int, int] = (0, 0),
) -> OnlinePoint:
    """The online point of `mode` at `aps`, at P/D `pd` in nodes (None: the setup's), with
    expert-parallel groups of `ep` = (prefill, decode) engines (0: the whole side)."""
    aps = round(aps, 4)
    return steady_point(ctx.runner.run(_spec(ctx, name, mode, aps, pd, ep)), aps)


MAX_DOUBLINGS = 6
"""The search doubles from the guess at most this often (64x): meeting the SLO there still, the
capacity is reported as a lower bound."""

MAX_HALVINGS = 4
"""The search halves from the guess at most this often (1/16): failing there still, the capacity
is reported as an upper bound."""


@dataclass(frozen=True)
class Capacity:
    """One system's SLO capacity as the search bracketed it: the true capacity lies in
    [passing_aps, failing_aps); either end may be open (0 or inf) when the search hit its limit."""

    passing_aps: float
    """Highest APS run that met the SLO (0: none did, down to guess/16)."""
    failing_aps: float
    """Lowest APS run above `passing_aps` that failed the SLO (inf: none did, up to 64x guess)."""
    points: tuple[OnlinePoint, ...]
    """Every point run, by APS."""

    @property
    def is_lower_bound(self) -> bool:
        """Met the SLO at the highest APS tried: the capacity is at least `passing_aps`."""
        return self.passing_aps > 0 and math.isinf(self.failing_aps)

    @property
    def is_upper_bound(self) -> bool:
        """Failed even at the lowest APS tried: the capacity is below `failing_aps`."""
        return self.passing_aps == 0

    @property
    def is_bracketed(self) -> bool:
        return not (self.is_lower_bound or self.is_upper_bound)

    def text(self, digits: int = 3) -> str:
        """`X` when bracketed, `>= X` for a lower bound, `< X` for an upper bound."""
        if self.is_upper_bound:
            return f"< {self.failing_aps:.{digits}f}"
        return (">= " if self.is_lower_bound else "") + f"{self.passing_aps:.{digits}f}"


def ratio_text(num: Capacity, den: Capacity) -> str:
    """`num / den` of reported capacities: with the range the two brackets allow when both are
    closed, else with the direction an open end allows, if any."""
    if num.is_bracketed and den.is_bracketed:
        return (f"{num.passing_aps / den.passing_aps:.2f}x "
                f"({num.passing_aps / den.failing_aps:.2f}-"
                f"{num.failing_aps / den.passing_aps:.2f}x)")
    if num.is_lower_bound and den.is_bracketed:
        return f">= {num.passing_aps / den.passing_aps:.2f}x"
    if num.is_bracketed and den.is_lower_bound:
        return f"<= {num.passing_aps / den.passing_aps:.2f}x"
    if den.is_upper_bound and not num.is_upper_bound:
        return f"> {num.passing_aps / den.failing_aps:.2f}x"
    if num.is_upper_bound and not den.is_upper_bound:
        return f"< {num.failing_aps / den.passing_aps:.2f}x"
    return "undetermined (both capacities are bounds on the same side)"


def capacity(
    ctx: Context, name: str, mode: str, steps: int, pd: tuple[int, int] | None = None,
    guess_aps: float = 0.0,
) -> Capacity:
    """Bracket the SLO capacity of `mode`: from the guess, double while the SLO is met (at most
    `MAX_DOUBLINGS` times) or halve while it fails (at most `MAX_HALVINGS` times), then bisect
    the bracket `steps` times."""
    pts: list[OnlinePoint] = []

    def meets(aps: float) -> tuple[bool, float]:
        p = point(ctx, name, mode, aps, pd)
        pts.append(p)
        return p.meets_slo, p.aps

    guess = guess_aps or APS_GUESS.get(name, 0.3)
    lo, hi = 0.0, math.inf
    ok, aps = meets(guess)
    if ok:
        lo = aps
        for k in range(1, MAX_DOUBLINGS + 1):
            ok, aps = meets(guess * 2**k)
            if not ok:
                hi = aps
                break
            lo = aps
    else:
        hi = aps
        for k in range(1, MAX_HALVINGS + 1):
            ok, aps = meets(guess / 2**k)
            if ok:
                lo = aps
                break
            hi = aps
    for _ in range(steps):
        if lo == 0 or math.isinf(hi):
            break
        mid = round((lo + hi) / 2, 4)
        if mid in (lo, hi):  # the bracket is narrower than the rounding of an APS
            break
        ok, aps = meets(mid)
        if ok:
            lo = aps
        else:
            hi = aps
    return Capacity(lo, hi, tuple(sorted(pts, key=lambda q: q.aps)))


CapacityTask = tuple[str, str, int, tuple[int, int] | None]
"""(setup, mode, bisection steps, P/D or None): one independent capacity search."""


def _capacity_in_worker(
    ctx: Context, task: CapacityTask
) -> tuple[Capacity, list[tuple[RunSpec, SimResult, float]]]:
    cap = capacity(ctx, *task)
    return cap, [(spec, ctx.runner.cache[spec], wall) for spec, wall in ctx.runner.log]


def capacities(ctx: Context, tasks: Sequence[CapacityTask]) -> list[Capacity]:
    """`capacity` of each task, `ctx.runner.jobs` searches at a time or each search one task on
    its Ray cluster (each search is adaptive and serial in itself; searches are independent).
    Results equal those of a serial run, and every run a worker made joins the parent's runner
    (cache, log, progress lines); a search that failed on the cluster runs here."""
    runner = ctx.runner
    if runner.ray is None and (runner.jobs <= 1 or len(tasks) <= 1):
        return [capacity(ctx, *t) for t in tasks]
    # Workers get a fresh runner: the parent's holds a progress callback and a cache too large
    # to send.
    bare = replace(ctx, runner=Runner())
    found: list[Capacity | None] = [None] * len(tasks)

    def done(i: int, out: tuple[Capacity, list[tuple[RunSpec, SimResult, float]]],
             node: str) -> None:
        found[i] = out[0]
        for spec, result, wall in out[1]:
            if spec not in runner.cache:
                runner.store(spec, result, wall, node=node)

    names = [f"capacity {name}{f' {pd[0]}P{pd[1]}D' if pd else ''} {mode}"
             for name, mode, _, pd in tasks]
    for i in runner.fan_out(partial(_capacity_in_worker, bare), tasks, names, done):
        found[i] = capacity(ctx, *tasks[i])
    return [cap for cap in found if cap is not None]
