"""Fit the synthetic generator's parameters to a Table 2 row (yours or the paper's).

Eight parameters are free: the natural length's mean and spread, its correlation with the append
level, the first append's mean, the later appends' mean, per-trajectory spread and decay, and the
generation mean. The other spreads are fixed shape choices (per-turn append sigma 0.6; first
append 0.3; generation 0.3 per trajectory and 0.6 per turn). The objective is the sum of squared
log-ratios of the five Table 2 statistics (Turns, Append, Gen, Total, Context) to their targets,
plus a penalty on spreads above 1, averaged over a few fixed seeds and minimized by Nelder-Mead;
the generator draws the same random stream for any parameters, so the objective is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from dualpath.core.validate import positive_int
from dualpath.workload.stats import table2_stats
from dualpath.workload.synthetic import SyntheticParams, Table2Row, generate_table

FloatArray = npt.NDArray[np.float64]

FIXED_FIRST_APPEND_SIGMA = 0.3
FIXED_APPEND_TURN_SIGMA = 0.6
FIXED_GEN_TRAJECTORY_SIGMA = 0.3
FIXED_GEN_TURN_SIGMA = 0.6


def _params(x: FloatArray, target: Table2Row, num_trajectories: int) -> SyntheticParams:
    return SyntheticParams(
        max_len_tokens=target.max_len_tokens,
        natural_total_mean_tokens=float(math.exp(x[0])),
        natural_total_sigma=abs(float(x[1])),
        first_append_mean_tokens=float(math.exp(x[2])),
        first_append_sigma=FIXED_FIRST_APPEND_SIGMA,
        append_mean_tokens=float(math.exp(x[3])),
        append_trajectory_sigma=abs(float(x[4])),
        append_turn_sigma=FIXED_APPEND_TURN_SIGMA,
        gen_mean_tokens=float(math.exp(x[5])),
        gen_trajectory_sigma=FIXED_GEN_TRAJECTORY_SIGMA,
        gen_turn_sigma=FIXED_GEN_TURN_SIGMA,
        natural_total_append_correlation=math.tanh(float(x[6])),
        append_decay_exponent=abs(float(x[7])),
        num_trajectories=num_trajectories,
    )


def relative_errors(params: SyntheticParams, target: Table2Row, seed: int = 0) -> dict[str, float]:
    """Generated / target - 1 for each Table 2 column and the paper's 1 - Append/Context."""
    s = table2_stats(generate_table(params, seed))
    return {
        "turns": s.turns / target.turns - 1,
        "append": s.append_tokens / target.append_tokens - 1,
        "gen": s.gen_tokens / target.gen_tokens - 1,
        "total": s.total_tokens / target.total_tokens - 1,
        "context": s.context_tokens / target.context_tokens - 1,
        "paper_hit_rate": s.paper_hit_rate / target.hit_rate - 1,
    }


def _objective(
    target: Table2Row, seeds: tuple[int, ...], num_trajectories: int
) -> Callable[[FloatArray], float]:
    def f(x: FloatArray) -> float:
        params = _params(x, target, num_trajectories)
        return sum(one(params, seed, x) for seed in seeds) / len(seeds)

    def one(params: SyntheticParams, seed: int, x: FloatArray) -> float:
        s = table2_stats(generate_table(params, seed))
        pairs = (
            (s.turns, target.turns), (s.append_tokens, target.append_tokens),
            (s.gen_tokens, target.gen_tokens), (s.total_tokens, target.total_tokens),
            (s.context_tokens, target.context_tokens),
        )
        # The hit rate is not a target: the paper's 1 - Append/Context is a shortcut, not the
        # pooled rate (see workload.stats). Sigmas beyond 1.5 are penalized as implausible.
        penalty = sum(max(0.0, abs(float(v)) - 1.0) ** 2 for v in (x[1], x[4]))
        return sum(math.log(got / want) ** 2 for got, want in pairs) + penalty

    return f


def nelder_mead(
    f: Callable[[FloatArray], float], x0: FloatArray, step: float = 0.2, max_iter: int = 400,
    tol: float = 1e-8, on_iteration: Callable[[float], None] | None = None,
) -> FloatArray:
    """Minimize `f` from `x0` with the standard Nelder-Mead simplex (deterministic).

    `on_iteration(best_value)` is called after every iteration (progress reporting).
    """
    dim = len(x0)
    simplex = [x0.astype(np.float64)]
    for i in range(dim):
        x = x0.astype(np.float64).copy()
        x[i] += step
        simplex.append(x)
    values = [f(x) for x in simplex]
    for _ in range(max_iter):
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if on_iteration is not None:
            on_iteration(values[0])
        if values[-1] - values[0] < tol:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        worst = simplex[-1]
        xr = centroid + (centroid - worst)
        fr = f(xr)
        if fr < values[0]:
            xe = centroid + 2 * (centroid - worst)
            fe = f(xe)
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (worst - centroid)
            fc = f(xc)
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:
                best = simplex[0]
                simplex = [best] + [best + 0.5 * (x - best) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]


def fit_params(
    target: Table2Row, seeds: tuple[int, ...] = (0, 1, 2), num_trajectories: int = 500,
    max_iter: int = 400, on_iteration: Callable[[float], None] | None = None,
) -> SyntheticParams:
    """Generator parameters whose output best matches `target` on average over `seeds`.

    Averaging over a few seeds fits the distribution rather than one seed's noise. Takes about a
    minute; the presets in `workload.synthetic` were produced by this function.
    """
    positive_int("fit_params", "num_trajectories", num_trajectories)
    x0 = np.array([
        math.log(target.max_len_tokens), 0.5,
        math.log(max(1.0, 2 * target.context_tokens - target.max_len_tokens, 500.0)),
        math.log(target.append_tokens * 0.8), 0.8, math.log(target.gen_tokens), 0.5, 0.1,
    ])
    if not seeds:
        positive_int("fit_params", "len(seeds)", 0)
    best = nelder_mead(_objective(target, seeds, num_trajectories), x0, max_iter=max_iter,
                       on_iteration=on_iteration)
    return _params(best, target, num_trajectories)
