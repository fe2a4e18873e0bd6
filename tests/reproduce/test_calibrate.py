"""Calibration: the least-squares fit recovers known parameters and lowers the residual of a
real (tiny) simulation; fitted values land in a copy of the cost file with a source note."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from dualpath.plan.runner import Runner, RunSpec
from dualpath.reproduce.calibrate import (
    Calibration,
    CellFit,
    calibrate_setup,
    fit_log_least_squares,
    oracle_growth,
    scaled_overrides,
    write_fitted,
)
from dualpath.sched.cost import default_cost_file, load_cost_coefficients


def test_fit_recovers_a_power_law() -> None:
    # Log-linear in the log-parameters, so damped Gauss-Newton lands near the truth at once.
    coef = [(1.0, 0.5), (0.8, 0.9), (0.3, 0.1)]
    true = (math.log(0.5), math.log(3.0))

    def model(x: list[float] | tuple[float, ...]) -> list[float]:
        return [math.exp(-a * x[0] + b * x[1]) for a, b in coef]

    targets = model(true)
    trace = fit_log_least_squares(model, targets, (0.0, 0.0), (10.0, 10.0), num_iters=2)
    assert trace.rms < 1e-3 < trace.initial_rms
    assert trace.x == pytest.approx(true, abs=1e-2)


def test_fit_respects_upper_bounds() -> None:
    trace = fit_log_least_squares(lambda x: [math.exp(-x[0])], [math.exp(-2.0)], (0.0,), (0.5,))
    assert trace.x[0] <= 0.5 + 1e-12


def test_fit_lowers_residual_of_tiny_simulation() -> None:
    runner = Runner()
    base = load_cost_coefficients("ds-27b", "h800-deepseek")

    def jcts(x: list[float] | tuple[float, ...]) -> list[float]:
        ov = scaled_overrides(base, math.exp(x[0]))
        return [runner.run(RunSpec("ds27b_1p1d", "oracle", n, "32k", cost_overrides=ov)).jct_s
                for n in (2, 6)]

    # A toy target the simulator itself made: every GPU time 2.5x longer.
    targets = jcts((math.log(2.5),))
    trace = fit_log_least_squares(jcts, targets, (0.0,), (5.0,), num_iters=1)
    assert trace.rms < 0.2 * trace.initial_rms
    assert trace.initial_rms > 0.3
    assert math.exp(trace.x[0]) == pytest.approx(2.5, rel=0.1)


def test_write_fitted_updates_copy_and_keeps_format(tmp_path: Path) -> None:
    path = tmp_path / "cost.json"
    shutil.copy(default_cost_file(), path)
    base = load_cost_coefficients("ds-27b", "*", path)
    fitted_ov = dict(scaled_overrides(base, 2.0, 0.35, 24))
    from dataclasses import replace

    fitted = replace(base, **fitted_ov)  # type: ignore[arg-type]
    cal = Calibration("ds27b_1p1d", "ds-27b", 2.0, 24, 0.35, base, fitted,
                      (CellFit(512, "32k", 390.0, 137.0, 380.0),), 4, 1.0, 0.03)
    write_fitted(cal, "fitted to a test target", path)
    loaded = load_cost_coefficients("ds-27b", "*", path)
    assert loaded.attention_efficiency == pytest.approx(base.attention_efficiency * 0.5, 1e-3)
    assert loaded.per_step_overhead_s == pytest.approx(base.per_step_overhead_s * 2.0, 1e-3)
    assert loaded.hbm_reserve_fraction == pytest.approx(0.35)
    assert loaded.max_seqs_per_decode_engine == 24
    assert loaded.source.startswith("fitted to a test target || prior: ")
    doc = json.loads(path.read_text())
    assert "about" in doc and len(doc["entries"]) >= 4


def test_growth_table_flags_a_paper_doubling_above_the_work() -> None:
    rows: list[list[object]] = [
        ["ds27b_1p1d", 1024, "48k", "held out", 920.0, 750.0, 0.2],
        ["ds27b_1p1d", 2048, "48k", "held out", 1600.0, 1240.0, 0.3],
        ["ds27b_1p1d", 4096, "48k", "held out", 3000.0, 3140.0, -0.04],
        ["ds27b_1p1d", 512, "32k", "fit", 370.0, 390.0, -0.05],
    ]
    text = "\n".join(oracle_growth(rows))
    assert "| DS 27B 1P1D | 48k | 1,024 -> 2,048 | 1.65x | 1.74x |" in text
    assert "| DS 27B 1P1D | 48k | 2,048 -> 4,096 | 2.53x | 1.88x |" in text
    assert "48k 2,048 -> 4,096 (2.53x)" in text and "1,024 -> 2,048 (" not in text
    assert oracle_growth(rows[3:]) == []  # no doubling among the cells


def test_calibrate_setup_scales_a_given_base() -> None:
    # A probe of another cost shape (research/pass_fixed_cost.py) fits k and the cap on top
    # of its own coefficients: the "before" runs are that base, and k scales its overheads.
    runner = Runner()
    packaged = load_cost_coefficients("ds-27b", "h800-deepseek")
    slow = replace(packaged, per_step_overhead_s=packaged.per_step_overhead_s + 0.05)
    cal = calibrate_setup(runner, "ds27b_1p1d", [(512, "32k")], num_iters=1,
                          agent_divisor=256, base=slow)
    as_given = scaled_overrides(slow, 1.0, slow.hbm_reserve_fraction,
                                slow.max_seqs_per_decode_engine)
    before = runner.run(RunSpec("ds27b_1p1d", "oracle", 2, "32k", cost_overrides=as_given)).jct_s
    packaged_jct = runner.run(RunSpec("ds27b_1p1d", "oracle", 2, "32k")).jct_s
    assert cal.cells[0].before_s == pytest.approx(before)
    assert before > packaged_jct
    assert cal.fitted.per_step_overhead_s == pytest.approx(
        slow.per_step_overhead_s * cal.gpu_time_scale)
