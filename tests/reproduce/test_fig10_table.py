"""Fig. 10's capacity table shows brackets and bounds as the search found them: driven by a
synthetic SLO per mode (a point meets it iff its APS is at most a threshold), no simulation."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath.plan import capacity as search
from dualpath.plan.capacity import OnlinePoint
from dualpath.plan.section import Context
from dualpath.reproduce import online


def test_fig10_tables_show_brackets_and_bounds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    thresholds = {"basic": 0.7, "dualpath": 1e9}

    def fake(ctx: Context, name: str, mode: str, aps: float,
             pd: tuple[int, int] | None = None) -> OnlinePoint:
        aps = round(aps, 4)
        ok = aps <= thresholds[mode]
        return OnlinePoint(aps, 1.0 if ok else 9.0, 0.05, 0.02, 100.0,
                           {"queue": 0.1, "allocation": 0.0, "read": 0.5, "prefill": 0.4},
                           "max_duration")

    # The search looks `point` up in `plan.capacity`; fig10_11's extra runs in `online`.
    monkeypatch.setattr(search, "point", fake)
    monkeypatch.setattr(online, "point", fake)
    sec = online.fig10_11(Context(tmp_path, is_quick=True, setups=("ds660b_2p4d",)))
    # basic: 0.3, 0.6 met, 1.2 failed; 2 bisections: 0.9 and 0.75 failed.
    assert "| 0.600 (fails at 0.750) | >= 19.200 | >= 32.00x | 2.25x |" in sec.body
