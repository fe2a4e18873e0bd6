"""The online capacity search brackets the capacity, or says it could not: driven by a synthetic
SLO (a point meets it iff its APS is at most a threshold), no simulation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dualpath.plan import advise as advisor
from dualpath.plan import capacity as search
from dualpath.plan.capacity import Capacity, OnlinePoint, capacity, ratio_text
from dualpath.plan.section import Context

GUESS = search.APS_GUESS["ds660b_2p4d"]


def _synthetic(monkeypatch: pytest.MonkeyPatch, threshold: float) -> list[float]:
    """Replace `capacity.point` by a threshold SLO; returns the APS values asked for, in order."""
    asked: list[float] = []

    def fake(ctx: Context, name: str, mode: str, aps: float,
             pd: tuple[int, int] | None = None) -> OnlinePoint:
        aps = round(aps, 4)
        asked.append(aps)
        ok = aps <= threshold
        return OnlinePoint(aps, 1.0 if ok else 9.0, 0.05, 0.02, 100.0,
                           {"queue": 0.0, "allocation": 0.0, "read": 0.5, "prefill": 0.5},
                           "max_duration")

    monkeypatch.setattr(search, "point", fake)
    return asked


def _cap(tmp_path: Path, steps: int = 4) -> Capacity:
    return capacity(Context(tmp_path), "ds660b_2p4d", "basic", steps)


@pytest.mark.parametrize("threshold", [0.1, 0.3, 0.675, 1.5, 5.0, 15.0])
def test_capacity_is_bracketed_around_the_threshold(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, threshold: float
) -> None:
    asked = _synthetic(monkeypatch, threshold)
    cap = _cap(tmp_path)
    assert cap.is_bracketed and not cap.is_lower_bound and not cap.is_upper_bound
    assert cap.passing_aps <= threshold < cap.failing_aps
    # 4 bisections shrink the first bracket [lo, 2 lo], lo <= passing, to 1/16 of its width.
    assert cap.failing_aps - cap.passing_aps <= cap.passing_aps / 16 + 1e-3
    assert cap.text() == f"{cap.passing_aps:.3f}"
    assert [p.aps for p in cap.points] == sorted(asked)
    assert len(asked) == len(set(asked))


def test_capacity_doubles_past_the_old_four_doublings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    asked = _synthetic(monkeypatch, 10.0)  # > 16x the guess: the old search stopped at 4.8
    cap = _cap(tmp_path, steps=0)
    assert asked == [GUESS * 2**k for k in range(7)][: len(asked)]
    assert (cap.passing_aps, cap.failing_aps) == (round(GUESS * 32, 4), round(GUESS * 64, 4))
    assert cap.is_bracketed


def test_capacity_met_at_the_cap_is_a_lower_bound(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    asked = _synthetic(monkeypatch, 1e9)
    cap = _cap(tmp_path)
    top = round(GUESS * 2**search.MAX_DOUBLINGS, 4)
    assert max(asked) == top and len(asked) == search.MAX_DOUBLINGS + 1  # no bisection
    assert cap.is_lower_bound and not cap.is_bracketed
    assert cap.passing_aps == top and math.isinf(cap.failing_aps)
    assert cap.text() == f">= {top:.3f}"


def test_capacity_failing_at_the_floor_is_an_upper_bound(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    asked = _synthetic(monkeypatch, 0.0)
    cap = _cap(tmp_path)
    floor = round(GUESS / 2**search.MAX_HALVINGS, 4)
    assert min(asked) == floor and len(asked) == search.MAX_HALVINGS + 1
    assert cap.is_upper_bound and not cap.is_bracketed
    assert (cap.passing_aps, cap.failing_aps) == (0.0, floor)
    assert cap.text() == f"< {floor:.3f}"


def _c(lo: float, hi: float) -> Capacity:
    return Capacity(lo, hi, ())


def test_ratio_text_states_what_the_bounds_allow() -> None:
    assert ratio_text(_c(1.5, 1.6), _c(0.6, 0.7)) == "2.50x (2.14-2.67x)"
    assert ratio_text(_c(19.2, math.inf), _c(0.6, 0.7)) == ">= 32.00x"
    assert ratio_text(_c(1.5, 1.6), _c(2.4, math.inf)) == "<= 0.62x"
    assert ratio_text(_c(0.3, 0.6), _c(0.0, 0.02)) == "> 15.00x"
    assert ratio_text(_c(0.0, 0.02), _c(0.3, 0.6)) == "< 0.07x"
    assert ratio_text(_c(19.2, math.inf), _c(19.2, math.inf)).startswith("undetermined")
    assert ratio_text(_c(0.0, 0.02), _c(0.0, 0.02)).startswith("undetermined")


def test_advise_reports_open_brackets_as_bounds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # advise imported `capacities`, which looks `point` up in `plan.capacity`: patched there.
    _synthetic(monkeypatch, 1e9)
    cands, sec = advisor.advise(Context(tmp_path), "ds660b_2p4d", [(2, 4)], ["basic"])
    top = GUESS * 2**search.MAX_DOUBLINGS
    assert cands[0].capacity_text == f">= {top:.3f}"
    assert cands[0].bottleneck == "no SLO violation found in the searched range"
    assert f"| >= {top:.3f} |" in sec.body
    _synthetic(monkeypatch, 1.0)
    cands, _ = advisor.advise(Context(tmp_path), "ds660b_2p4d", [(2, 4)], ["basic"])
    assert cands[0].capacity_text == f"{cands[0].capacity_aps:.3f}"
    # 2 bisections: 0.9 met, 1.05 failed; the bottleneck is read at the lowest failing point.
    assert cands[0].bottleneck.startswith("TTFT 9.0 s > 4 s at 1.050 APS")
