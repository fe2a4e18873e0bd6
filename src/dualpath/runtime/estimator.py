"""The PE's forward-pass time estimator, measured on this machine at node start-up.

`pack_prefill_batch` packs under a quota of estimated attention time (paper §6.2; 300 ms on
the paper's GPUs). The runtime's engines are CPU threads running a real model, so the estimate
that makes the quota mean something here is the time this model's forward pass takes on this
CPU. `measure_estimator` times whole prefill passes of a few sizes (no cache) and fits

    t(pass of pairs (c_i, b_i)) = fixed_s + sum_i b_i * (per_token_s + per_pair_s * (c_i + b_i))

(linear layers per new token; attention per (query, key) pair: the model's masked attention
computes every query against all `cached + bsz` keys). It estimates whole layers, not only
attention: on a CPU engine there is no separate FFN phase to overlap. The alternative,
`cost_model_estimator`, is the `sched` cost model on the `cpu-emulated` preset (deterministic,
not fitted to this machine).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dualpath.core.errors import SpecError
from dualpath.core.hardware import hardware_preset
from dualpath.core.validate import non_negative
from dualpath.sched.cost import AttentionTimeEstimator, CostModelEstimator, coefficients_for

ESTIMATORS = ("measured", "cost-model")


@dataclass(frozen=True)
class MeasuredEstimator:
    """Fitted forward-pass time (an `AttentionTimeEstimator`): non-negative coefficients, so
    `pair_time_s` is 0 at `bsz == 0` and non-decreasing in `bsz`."""

    fixed_s: float
    per_token_s: float
    per_pair_s: float

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_token_s", "per_pair_s"):
            non_negative("measured_estimator", name, getattr(self, name))

    def fixed_time_s(self) -> float:
        return self.fixed_s

    def pair_time_s(self, cached_tokens: int, new_tokens: int) -> float:
        b = new_tokens
        return b * (self.per_token_s + self.per_pair_s * (cached_tokens + b))

    def describe(self) -> str:
        return (
            f"measured: {self.fixed_s * 1e3:.2f} ms + {self.per_token_s * 1e6:.2f} us/token + "
            f"{self.per_pair_s * 1e9:.3f} ns/(query,key)"
        )


def fit(samples: list[tuple[int, float]]) -> MeasuredEstimator:
    """Least-squares fit of `t = fixed + a*b + c*b*b` to `(bsz, seconds)` samples of uncached
    passes, coefficients clamped to >= 0 (a negative one is dropped and the rest refit)."""
    if len(samples) < 3:
        raise SpecError("estimator", "samples", len(samples), "need at least 3 pass sizes")
    b = np.array([s[0] for s in samples], dtype=np.float64)
    t = np.array([s[1] for s in samples], dtype=np.float64)
    columns = [np.ones_like(b), b, b * b]
    keep = [0, 1, 2]
    coef = np.zeros(3)
    while keep:
        a = np.stack([columns[i] for i in keep], axis=1)
        sol, *_ = np.linalg.lstsq(a, t, rcond=None)
        if (sol >= 0).all():
            for i, v in zip(keep, sol, strict=True):
                coef[i] = float(v)
            break
        keep.pop(int(np.argmin(sol)))
    return MeasuredEstimator(float(coef[0]), float(coef[1]), float(coef[2]))


def measure_estimator(
    model: Any, sizes: tuple[int, ...] = (32, 128, 512), repeats: int = 3, max_tries: int = 3
) -> MeasuredEstimator:
    """Time uncached prefills of `sizes` tokens (best of `repeats`, after one warm-up pass)
    and fit `MeasuredEstimator`. A machine shared with other work can stall a small pass
    until it looks no cheaper than a big one; a fit in which time does not grow with the
    tokens is then measured again (up to `max_tries` times; the last fit is kept). Costs a few
    passes of at most `max(sizes)` tokens."""
    vocab = model.config.vocab_size
    sizes = tuple(min(n, model.config.max_position_tokens) for n in sizes)
    est = MeasuredEstimator(0.0, 0.0, 0.0)
    with torch.inference_mode():
        model.prefill([1 % vocab] * sizes[0])
        for _ in range(max_tries):
            samples = []
            for n in sizes:
                ids = [(7 * i + 3) % vocab for i in range(n)]
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    model.prefill(ids)
                    best = min(best, time.perf_counter() - start)
                samples.append((n, best))
            est = fit(samples)
            if est.per_token_s > 0 or est.per_pair_s > 0:
                break
    return est


def cost_model_estimator(model: Any) -> CostModelEstimator:
    """The `sched` cost model of `model`'s config on the `cpu-emulated` preset (packaged
    coefficients, not fitted to this machine)."""
    spec = model.config.to_model_spec()
    hw = hardware_preset("cpu-emulated")
    return CostModelEstimator(spec, hw, coefficients_for(spec, hw))


def make_estimator(kind: str, model: Any) -> AttentionTimeEstimator:
    """`measured` (timed now, on this machine) or `cost-model`."""
    if kind == "measured":
        return measure_estimator(model)
    if kind == "cost-model":
        return cost_model_estimator(model)
    raise SpecError("estimator", "kind", kind, f"must be one of {', '.join(ESTIMATORS)}")


def describe(estimator: AttentionTimeEstimator) -> str:
    """One line naming the estimator and, for a measured one, its coefficients."""
    if isinstance(estimator, MeasuredEstimator):
        return estimator.describe()
    return "cost-model (cpu-emulated preset)"
