"""`dualpath profile` on the tiny model: what it measures, the file it writes, and
`dualpath simulate --profile` reading it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.cli.main import main
from dualpath.plan.step_profile import load_profile
from dualpath.runtime.model.weights import tiny_random_model
from dualpath.runtime.profiler import QUICK_GRID, measure, num_points
from dualpath.workload.jsonl import save_trajectories, trajectory_file
from dualpath.workload.synthetic import generate, preset


def test_measure_covers_the_grid() -> None:
    labels: list[str] = []
    m = measure(tiny_random_model(0), QUICK_GRID, on_point=labels.append)
    assert len(labels) == num_points(QUICK_GRID)
    assert {(s["cached"], s["new"], s["batch"]) for s in m.prefill} == {
        (c, n, b) for c in QUICK_GRID.prefill_cached for n in QUICK_GRID.prefill_new
        for b in QUICK_GRID.prefill_batch}
    assert len(m.decode) == len(QUICK_GRID.decode_batch) * len(QUICK_GRID.decode_context)
    assert all(s["seconds"] > 0 for s in [*m.prefill, *m.decode])
    assert m.kv_bytes_per_token == 4 * 2 * 2 * 16 * 4  # layers x K,V x kv heads x dim x fp32
    assert set(m.rates) == {"memory_copy", "store_write", "store_read"}


def test_profile_then_simulate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny.json"
    assert main(["profile", "--model", "tiny", "--quick", "--no-progress", "--out",
                 str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    prof = load_profile(out)
    data = json.loads(out.read_text())
    assert data["engine"]["kind"] == "dualpath-runtime" and data["model"]["num_layers"] == 4
    # The run configuration is `dualpath run`'s default for tiny: the preset's NICs x 1/64.
    assert prof.run["storage_nic_bytes_per_s"] == pytest.approx(200 * 2**20 / 64)
    assert prof.run["engines_per_node"] == 2
    # --quick times 3 turns through the emulated cluster: the control plane's latencies.
    assert len(data["measured"]["turns"]) == 3
    for row in data["measured"]["turns"]:
        assert 0 < row["first_token_s"] < row["next_submit_s"]
    dispatch_s, return_s = prof.control_plane()
    assert dispatch_s > 0 and return_s >= 0
    assert prof.sim_kwargs()["params"].turn_dispatch_s == dispatch_s

    trajs = tmp_path / "t.jsonl"
    save_trajectories(trajs, trajectory_file(generate(preset("32k").with_num_trajectories(2), 0)))
    args = ["simulate", "--profile", str(out), "--prefill-nodes", "1", "--decode-nodes", "2",
            "--trajectories", str(trajs), "--agents", "2", "--mal", "1024",
            "--append-scale", "0.25", "--gen-scale", "0.05", "--mode", "basic,dualpath",
            "--json", "--no-progress"]
    assert main(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["basic"]["num_completed"] == res["basic"]["num_requests"] > 2
    assert res["basic"]["cluster"] == res["dualpath"]["cluster"]


def test_bad_profile_is_one_line_naming_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "dualpath-profile", "version": 1}), encoding="utf-8")
    assert main(["simulate", "--profile", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "field 'created'" in err[0]
