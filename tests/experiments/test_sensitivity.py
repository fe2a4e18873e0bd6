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
    nominal, half = rows
    assert float(half["snic_gb_per_s"]) == float(nominal["snic_gb_per_s"]) / 2
    # Oracle does no I/O; less storage bandwidth never shortens Basic or DualPath.
    assert half["oracle_jct_s"] == nominal["oracle_jct_s"]
    assert float(half["basic_jct_s"]) >= float(nominal["basic_jct_s"])
    assert float(half["dualpath_jct_s"]) >= float(nominal["dualpath_jct_s"])
    # Basic's mean rate per prefill node stays within that node's storage NIC.
    for r in rows:
        assert 0 < float(r["basic_read_gb_per_s_per_pe_node"]) <= float(r["snic_gb_per_s"])
    assert "paper's implied rate" in sec.body and (tmp_path / "storage_rate.png").exists()
