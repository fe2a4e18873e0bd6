"""End to end on an I/O-bound emulated 1P2D cluster: Basic and +layerwise read through the
prefill node's storage NIC only, +dual-path and DualPath through every node's, Oracle is not
slower than DualPath, every mode generates the same tokens; and the `dualpath run` command with
real node processes."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from dualpath.cli.main import main
from dualpath.core.errors import SpecError
from dualpath.runtime.agent_replay import RunResult, agents_from_lengths, replay
from dualpath.runtime.emulated_cluster import Cluster, RunError
from dualpath.runtime.run_config import RunConfig
from dualpath.workload.jsonl import TrajectoryFile, save_trajectories
from dualpath.workload.trajectory import Trajectory

MiB = 2**20
# Eight agents: a long first prompt, then two short appends that hit ~1000 tokens of stored KV.
TURNS = [([1000 + 17 * a, 20, 20], [2, 2, 2]) for a in range(8)]


def run_mode(tmp_path: Path, mode: str) -> RunResult:
    cfg = RunConfig(
        mode=mode,
        store_root=str(tmp_path / mode),
        launch="thread",
        num_prefill_nodes=1,
        num_decode_nodes=2,
        engines_per_node=1,
        # I/O bound: a storage NIC reads ~2k tokens/s of the tiny model's 1 KiB/token KV.
        storage_nic_bytes_per_s=2 * MiB,
        compute_nic_bytes_per_s=16 * MiB,
        buffer_bytes=16 * MiB,
        hbm_bytes=32 * MiB,
        transfer_kind="shm",
    )
    cluster = Cluster(cfg)
    return replay(cluster, agents_from_lengths(TURNS, cluster.vocab_size, seed=0), timeout_s=120)


def busiest_snic_s(r: RunResult) -> float:
    """The run's lower bound set by storage reads: the busiest storage NIC's busy time."""
    return max(u * r.jct_s for u in r.snic_read_utilization().values())


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    tmp = tmp_path_factory.mktemp("run")
    return {m: run_mode(tmp, m) for m in ("basic", "layerwise", "dual-path", "dualpath", "oracle")}


def test_all_modes_generate_the_same_tokens(results: dict[str, RunResult]) -> None:
    outs = {m: r.outputs for m, r in results.items()}
    assert all(out == outs["basic"] for out in outs.values())
    assert all(r.num_hit_tokens == results["basic"].num_hit_tokens > 0 for r in results.values())


@pytest.mark.parametrize("mode", ["basic", "layerwise"])
def test_pe_path_modes_read_only_through_the_prefill_node(
    results: dict[str, RunResult], mode: str
) -> None:
    r = results[mode]
    util = r.snic_read_utilization()
    assert util[0] > 0 and util[1] == util[2] == 0
    assert r.bytes_by_path()["pe_read"] == r.num_hit_tokens * 1024


def test_the_dual_path_step_reads_through_every_node_under_round_robin(
    results: dict[str, RunResult],
) -> None:
    r = results["dual-path"]
    assert all(u > 0 for u in r.snic_read_utilization().values())
    b = r.bytes_by_path()
    assert b["de_read"] > 0 and b["pe_read"] + b["de_read"] == r.num_hit_tokens * 1024


def test_dualpath_reads_through_every_node_and_relieves_the_bottleneck(
    results: dict[str, RunResult],
) -> None:
    basic, dual = results["basic"], results["dualpath"]
    assert all(u > 0 for u in dual.snic_read_utilization().values())
    b = dual.bytes_by_path()
    assert b["pe_read"] + b["de_read"] == dual.num_hit_tokens * 1024
    # The storage-read floor under JCT (busiest NIC's busy time) drops by >= 1.5x.
    assert busiest_snic_s(basic) >= 1.5 * busiest_snic_s(dual)
    assert basic.jct_s > dual.jct_s


def test_oracle_is_not_slower_than_dualpath(results: dict[str, RunResult]) -> None:
    assert results["oracle"].jct_s <= results["dualpath"].jct_s
    assert all(u == 0 for u in results["oracle"].snic_read_utilization().values())


def test_run_command_with_node_processes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "run",
            "--mode",
            "dualpath",
            "--agents",
            "2",
            "--max-len",
            "400",
            "--gen-scale",
            "0.02",
            "--prefill-nodes",
            "1",
            "--decode-nodes",
            "1",
            "--engines-per-node",
            "1",
            "--buffer-mib",
            "16",
            "--hbm-mib",
            "32",
            "--store",
            str(tmp_path),
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dualpath"]["num_turns"] >= 2 and out["dualpath"]["generated_tokens"] > 0
    assert set(out["dualpath"]["snic_read_utilization"]) == {"0", "1"}


def test_run_command_takes_a_list_of_modes_and_refuses_an_unknown_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", "--mode", "basic,layrwise"])
    assert exc.value.code == 2
    assert "unknown mode layrwise" in capsys.readouterr().err
    with pytest.raises(SpecError, match="must be one of basic, layerwise, dual-path"):
        RunConfig(mode="layrwise", store_root=".")


def test_run_command_rejects_an_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", "/nonexistent/model", "--mode", "basic"]) == 2
    assert "run.model='/nonexistent/model'" in capsys.readouterr().err


def test_run_command_replays_a_trajectory_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "agents.jsonl"
    trajs = (Trajectory((150, 30), (3, 2), "a"), Trajectory((90, 80, 10), (2, 2, 2), "b"))
    save_trajectories(path, TrajectoryFile(trajs))
    args = [
        "run",
        "--mode",
        "oracle",
        "--trajectories",
        str(path),
        "--append-scale",
        "1",
        "--gen-scale",
        "1",
        "--launch",
        "thread",
        "--decode-nodes",
        "1",
        "--json",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)["oracle"]
    assert out["num_turns"] == 5 and out["generated_tokens"] == 11
    path.write_text(path.read_text().replace('"gen_tokens"', '"gen_tokns"'))
    assert main(args) == 2
    assert f"{path}:2" in capsys.readouterr().err


def test_a_node_process_that_dies_ends_the_run_with_an_error(tmp_path: Path) -> None:
    # kill -9 a node after start-up: it can send no failure message, so the driver must see
    # the dead process itself (within about a second) instead of waiting out the timeout.
    cfg = RunConfig(mode="dualpath", store_root=str(tmp_path), launch="process",
                    num_prefill_nodes=1, num_decode_nodes=1, engines_per_node=1,
                    buffer_bytes=16 * MiB, hbm_bytes=32 * MiB, transfer_kind="shm")
    cluster = Cluster(cfg)
    try:
        victim = cluster._procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=10)
        started = time.monotonic()
        with pytest.raises(RunError, match=r"node 1 process exited with code -9"):
            replay(cluster, agents_from_lengths(TURNS[:2], cluster.vocab_size, seed=0),
                   timeout_s=120)
        assert time.monotonic() - started < 60
    finally:
        cluster.close()
