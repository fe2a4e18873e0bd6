"""The paper's load-balance metrics (Figs. 13-14) on hand-built numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dualpath.sim.result import binned_step_balance, mean_finite, window_max_over_avg


def test_storage_max_over_avg_is_per_window_across_machines() -> None:
    # Window 0: two machines read 3 and 1 (max 3 / mean 2 = 1.5); window 1: none read (NaN);
    # window 2: 1 and 3 (1.5); window 3: 1 and 1 (1.0). Their totals (5, 5) would read 1.0:
    # the windows are not pooled.
    b = np.array([[3.0, 0.0, 1.0, 1.0], [1.0, 0.0, 3.0, 1.0]])
    r = window_max_over_avg(b)
    assert r[0] == 1.5 and math.isnan(r[1]) and r[2] == 1.5 and r[3] == 1.0
    assert mean_finite(r) == pytest.approx(4.0 / 3.0)
    # Weighted by the bytes read in each window: (1.5 * 4 + 1.5 * 4 + 1.0 * 2) / 10.
    assert mean_finite(r, weights=b.sum(axis=0)) == pytest.approx(1.4)
    # Three machines, one idle in the window: max 3 / mean (3 + 1 + 0) / 3 = 2.25.
    assert window_max_over_avg([[3.0], [1.0], [0.0]])[0] == 2.25


def test_no_reads_at_all_reads_as_balanced() -> None:
    assert mean_finite(window_max_over_avg([[0.0, 0.0], [0.0, 0.0]])) == 1.0
    assert len(window_max_over_avg([])) == 0


def test_attention_balance_per_step_first_five_percent_and_whole_run() -> None:
    # 1 s bins; bin 0 holds two steps (ratios 1.2 and 1.0), bin 1 none, bin 2 one (2.0),
    # bin 30 one (1.5). Run of 40 s: the first 5% is 2 s, i.e. bins 0 and 1.
    sums = [2.2, 0.0, 2.0] + [0.0] * 27 + [1.5]
    steps = [2, 0, 1] + [0] * 27 + [1]
    series, whole, early = binned_step_balance(sums, steps, 1.0, 40.0)
    assert series[0] == pytest.approx(1.1) and math.isnan(series[1]) and series[2] == 2.0
    assert whole == pytest.approx(5.7 / 4)
    assert early == pytest.approx(1.1)
    # A 60 s run's first 5% (3 s) takes bin 2 as well.
    assert binned_step_balance(sums, steps, 1.0, 60.0)[2] == pytest.approx(4.2 / 3)
    # No synchronized step: 1.0 (nothing out of balance).
    assert binned_step_balance([], [], 1.0, 10.0)[1:] == (1.0, 1.0)
