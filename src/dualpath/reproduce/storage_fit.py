"""Fit the storage system's effective read rate (`dualpath.core.read_rate`) on the one part of
Fig. 7 the decision allows: DS 27B 1P1D Basic, the 32K and 64K columns. Every other cell (all
of DS 660B, every DualPath cell, the 48K column, every other figure) is a prediction.

Why these cells identify the storage rate: Basic reads every hit token through the one prefill
node's storage NIC, and DS 27B's HBM and compute leave that NIC the bottleneck, so these JCTs
are set by how fast it moves KV. They hold a single block size (DS 27B's 1.39 MB Full Block), so
they fix one number: the rate for that block size, as a fraction of the line rate. Either form
of `StorageReadModel` (a flat fraction of the line rate, or a fixed cost per block on top of
it) then follows in closed form (`model_of`), and both give the fitted cells the same JCTs; they
differ only for other block sizes, which is what the report compares.

The fit minimizes the sum of squared log residuals over that one log-fraction by golden-section
search on [MIN_FRACTION, 1]: JCT is monotone in the rate but bends sharply where a run stops
being storage-bound, which throws a Gauss-Newton step far off; a bracketing search does not
care.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

from dualpath.core.read_rate import (
    STORAGE_FORMS,
    StorageReadModel,
    storage_read_model,
    write_storage_record,
)
from dualpath.plan.runner import Runner, RunSpec, storage_fraction
from dualpath.plan.setups import HARDWARE, setup
from dualpath.plan.storage_note import FIT_SETUP, fit_block_bytes
from dualpath.reproduce.calibrate import CalibrationError, CellFit, rms_of
from dualpath.reproduce.paper import Fig7Point, fig7

FIT_SYSTEM = "basic"
FIT_CELLS: tuple[tuple[int, str], ...] = tuple(
    (a, mal) for mal in ("32k", "64k") for a in (512, 1024, 2048, 4096))
"""(agents, MAL) of the fitted cells: Fig. 7 DS 27B 1P1D Basic at 32K and 64K."""

FORM = "flat"
"""The form `reproduce calibrate-storage --write` records (why: docs/reproduction/README.md)."""

MIN_FRACTION = 0.05
"""The search's lower bound on the fraction of the line rate (the upper is 1)."""
LOG_TOLERANCE = 0.005
"""The search stops once its bracket is this narrow in ln(fraction): 0.5%."""
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def golden_section_min(cost: Callable[[float], float], lo: float, hi: float,
                       tol: float) -> tuple[float, int]:
    """The x in [lo, hi] minimizing a unimodal `cost`, to within `tol`; and the evaluations."""
    a, b = lo, hi
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    fc, fd = cost(c), cost(d)
    evals = 2
    while b - a > tol:
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - _GOLDEN * (b - a)
            fc = cost(c)
        else:
            a, c, fc = c, d, fd
            d = a + _GOLDEN * (b - a)
            fd = cost(d)
        evals += 1
    return (c if fc <= fd else d), evals


STORAGE_RECORD = "storage_fit.json"


@dataclass(frozen=True)
class StorageFit:
    """One fitted form: its model, the fitted cells before (nominal) and after."""

    form: str
    model: StorageReadModel
    cells: tuple[CellFit, ...]
    num_evals: int
    rms_log_before: float
    rms_log_after: float
    agent_divisor: int = 1


def model_of(form: str, fraction: float, source: str = "") -> StorageReadModel:
    """The read model of `form` that reads the fitted setup's Full Blocks at `fraction` of
    the line rate: `flat` has that efficiency; `per_block` the overhead S * (1/f - 1) / R;
    `queued` the reads in flight C = f * R * (L + S / r) / S (3FS's L and r; below its cap)."""
    if form == "flat":
        return StorageReadModel(read_efficiency=fraction, source=source)
    nominal = setup(FIT_SETUP).cluster().hardware.storage_nic_bytes_per_s
    if form == "per_block":
        return StorageReadModel(
            per_block_overhead_s=fit_block_bytes() * (1.0 / fraction - 1.0) / nominal,
            source=source)
    if form == "queued":
        queued = StorageReadModel(reads_in_flight=1.0)
        if fraction >= queued.peak_fraction:
            raise CalibrationError(
                f"storage fraction {fraction:.3f}: the queued form reads at most "
                f"{queued.peak_fraction:g} of the line rate")
        s = fit_block_bytes()
        return replace(queued, reads_in_flight=fraction * nominal * queued.read_time_s(s) / s,
                       source=source)
    raise CalibrationError(f"storage form {form!r}: must be one of {', '.join(STORAGE_FORMS)}")


def fit_targets(points: Sequence[Fig7Point]) -> list[float]:
    """The paper's JCTs of the fitted cells, in `FIT_CELLS` order, from all of `points`
    (whatever else they hold is not read)."""
    by_cell = {(p.agents, p.mal): p for p in points if p.setup == FIT_SETUP}
    out = []
    for cell in FIT_CELLS:
        p = by_cell.get(cell)
        if p is None or FIT_SYSTEM not in p.jct_s:
            raise CalibrationError(f"no Fig. 7 {FIT_SYSTEM} value for {FIT_SETUP} {cell}")
        out.append(p.jct_s[FIT_SYSTEM])
    return out


def fit_storage(
    runner: Runner, form: str = FORM, *, points: Sequence[Fig7Point] | None = None,
    agent_divisor: int = 1, log_tolerance: float = LOG_TOLERANCE,
) -> StorageFit:
    """Fit the read rate of the fitted setup's blocks so that simulated DS 27B 1P1D Basic JCTs
    match the paper's at `FIT_CELLS`, as a model of `form`. `points`: the paper's Fig. 7
    cells (default: the packaged ones); only the fitted cells are read. `agent_divisor > 1`
    runs each cell with that many times fewer agents against the paper value divided alike
    (storage-bound JCT grows about linearly with agents): a smoke run, not the fit."""
    targets = [t / agent_divisor
               for t in fit_targets(points if points is not None else fig7(FIT_SETUP))]

    def _agents(paper_agents: int) -> int:
        return max(1, paper_agents // agent_divisor)

    def specs(model: StorageReadModel) -> list[RunSpec]:
        storage = (model.read_efficiency, model.per_block_overhead_s)
        return [RunSpec(FIT_SETUP, FIT_SYSTEM, _agents(a), mal, storage=storage)
                for a, mal in FIT_CELLS]

    def jcts(model: StorageReadModel) -> list[float]:
        runner.prefetch(specs(model))
        return [runner.run(sp).jct_s for sp in specs(model)]

    def rms_log(jct: Sequence[float]) -> float:
        return rms_of([math.log(j / t) for j, t in zip(jct, targets, strict=True)])

    x, num_evals = golden_section_min(lambda x: rms_log(jcts(model_of(form, math.exp(x)))),
                                      math.log(MIN_FRACTION), 0.0, log_tolerance)
    value = math.exp(x)
    before = jcts(StorageReadModel())
    after = jcts(model_of(form, value))
    cells = tuple(CellFit(_agents(a), mal, t, b, f) for (a, mal), t, b, f
                  in zip(FIT_CELLS, targets, before, after, strict=True))
    rms_before, rms_after = rms_log(before), rms_log(after)
    note = (f"fitted by `dualpath reproduce calibrate-storage` ({form}) to paper Fig. 7 "
            f"{FIT_SETUP} {FIT_SYSTEM} JCTs at (agents, MAL) {list(FIT_CELLS)}"
            + (f" with agents / {agent_divisor}" if agent_divisor > 1 else "")
            + f": RMS log residual {rms_after:.3f} (nominal rate: {rms_before:.3f}); residuals "
            + ", ".join(f"{100 * c.residual:+.1f}%" for c in cells))
    return StorageFit(form, model_of(form, value, note), cells, num_evals, rms_before,
                      rms_after, agent_divisor)


def write_fit(fit: StorageFit) -> None:
    """Record `fit` as the packaged storage model of the paper's hardware."""
    write_storage_record(HARDWARE, fit.model, {
        "form": fit.form,
        "fitted_cells": [f"{FIT_SETUP} {FIT_SYSTEM} {a} agents {mal}" for a, mal in FIT_CELLS],
        "rms_log_residual": round(fit.rms_log_after, 4),
    })


def calibrate_storage(runner: Runner, *, agent_divisor: int = 1) -> list[StorageFit]:
    """Fit the rate once; the recorded form first, then the other form at the same rate
    (its fitted cells are the same runs: the simulator sees only the rate)."""
    first = fit_storage(runner, FORM, agent_divisor=agent_divisor)
    fraction = storage_fraction(first.model, FIT_SETUP)
    note = first.model.source.replace(f"({FORM})", f"(as {FORM}, at the same rate)")
    others = [replace(first, form=f, model=model_of(f, fraction, note))
              for f in STORAGE_FORMS if f != FORM]
    return [first, *others]


def fits_to_json(fits: Sequence[StorageFit], wall_s: float) -> str:
    """The record `reproduce calibrate-storage` stores beside its figures."""
    return json.dumps({"wall_s": wall_s, "fits": [asdict(f) for f in fits]}, indent=1) + "\n"


def fits_from_json(text: str) -> list[StorageFit]:
    doc = json.loads(text)
    out = []
    for f in doc["fits"]:
        cells = tuple(CellFit(**c) for c in f["cells"])
        out.append(StorageFit(f["form"], StorageReadModel(**f["model"]), cells, f["num_evals"],
                              f["rms_log_before"], f["rms_log_after"], f["agent_divisor"]))
    return out


def packaged_model() -> StorageReadModel:
    """The storage read model the simulator uses for the paper's hardware."""
    return storage_read_model(HARDWARE)


