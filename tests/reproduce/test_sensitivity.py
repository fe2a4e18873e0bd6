"""The storage section: fitted and predicted residuals apart, calibrated and nominal runs."""

from __future__ import annotations

import csv
from pathlib import Path

from dualpath.plan.section import Context
from dualpath.reproduce.sensitivity import storage_section


def test_storage_section_splits_fitted_from_predicted(tmp_path: Path) -> None:
    sec = storage_section(Context(tmp_path, is_quick=True, agents=(4,), mals=("32k",)))
    assert sec.key == "storage"  # the experiment name: `reproduce report` finds it
    with open(tmp_path / "storage.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert {(r["setup"], r["mode"]) for r in rows} == {
        (s, m) for s in ("ds660b_2p4d", "ds27b_1p1d") for m in ("basic", "dualpath")}
    # 4 agents has no paper cell: nothing is fitted at this size.
    assert {r["role"] for r in rows} == {"predicted"}
    for r in rows:  # a slower storage read never shortens a run
        assert float(r["sim_jct_s"]) >= float(r["sim_jct_nominal_storage_s"]) * 0.999
    assert "fitted RMS log" in sec.body and "reads in flight" in sec.body
    assert "queued form" in sec.body  # the 3FS-derived form beside the packaged flat one
    assert (tmp_path / "storage_residuals.png").exists()
