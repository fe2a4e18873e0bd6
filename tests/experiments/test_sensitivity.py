from __future__ import annotations

import csv
from pathlib import Path

from dualpath.experiments.report import Context
from dualpath.experiments.sensitivity import storage_rate


def test_storage_rate_section_reports_both_rates_and_the_half_rate_runs(tmp_path: Path) -> None:
    sec = storage_rate(Context(tmp_path, is_quick=True, agents=(6,)))
    assert sec.key == "storage-rate"  # the experiment name: `reproduce report` finds it
    with open(tmp_path / "storage_rate.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["setup"] for r in rows] == ["ds660b_2p4d"] * 2 + ["ds27b_1p1d"] * 2
    for nominal, half in (rows[:2], rows[2:]):
        assert float(half["snic_gb_per_s"]) == float(nominal["snic_gb_per_s"]) / 2
        # Oracle does no I/O; less storage bandwidth never shortens Basic or DualPath.
        assert half["oracle_jct_s"] == nominal["oracle_jct_s"]
        assert float(half["basic_jct_s"]) >= float(nominal["basic_jct_s"])
        assert float(half["dualpath_jct_s"]) >= float(nominal["dualpath_jct_s"])
    # Mean rates per node stay within that node's storage NIC.
    for r in rows:
        assert 0 < float(r["basic_read_gb_per_s_per_pe_node"]) <= float(r["snic_gb_per_s"])
        assert 0 < float(r["dualpath_read_gb_per_s_per_node"]) <= float(r["snic_gb_per_s"])
    assert "paper's Basic rate" in sec.body
    assert (tmp_path / "storage_rate_ds660b_2p4d.png").exists()
    assert (tmp_path / "storage_rate_ds27b_1p1d.png").exists()
