"""The runtime and the server over a faulty store: a full disk (persistence skipped and
counted, serving goes on) and foreign files at blocks' paths (counted misses, recomputed).
Outputs never change: a lost block only costs recompute."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from dualpath.cli.main import main
from dualpath.runtime.agent_replay import RunResult, agents_from_lengths, replay
from dualpath.runtime.emulated_cluster import Cluster
from dualpath.runtime.model.model_source import ModelSource, model_tokenizer
from dualpath.runtime.model.sampling import SamplingParams
from dualpath.runtime.run_config import RunConfig
from dualpath.serve import GenerateRequest, ServingEngine

Mount = Callable[[int], Path]
"""The `tmpfs` fixture: mount a tmpfs of this many bytes, get its folder."""
MiB = 2**20
FULL_DISK_BYTES = 256 * 1024
"""Holds three 64 KiB blocks of the tiny model: most of a run's blocks find no room."""
# Two agents, three turns each; later turns extend the earlier context, so they would hit.
TURNS = [([300, 40, 70], [8, 8, 40]), ([200, 100, 5], [5, 30, 3])]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(store: Path) -> RunResult:
    cfg = RunConfig(mode="dualpath", store_root=str(store), launch="thread",
                    num_prefill_nodes=1, num_decode_nodes=1, engines_per_node=1,
                    buffer_bytes=8 * MiB, hbm_bytes=16 * MiB, transfer_kind="shm")
    cluster = Cluster(cfg)
    return replay(cluster, agents_from_lengths(TURNS, cluster.vocab_size, seed=0), timeout_s=120)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """The run on a healthy store, to compare with."""
    return run(tmp_path_factory.mktemp("clean") / "store")


def test_a_full_disk_skips_persistence_and_the_run_goes_on(
    tmpfs: Mount, clean: RunResult
) -> None:
    full = run(tmpfs(FULL_DISK_BYTES) / "store")
    assert full.outputs == clean.outputs
    assert full.num_unpersisted_blocks > 0
    assert full.to_dict()["unpersisted_blocks"] == full.num_unpersisted_blocks
    assert full.num_hit_tokens < clean.num_hit_tokens  # the skipped blocks were recomputed
    assert clean.num_unpersisted_blocks == 0


def test_foreign_files_at_block_paths_are_counted_misses_in_a_run(
    tmp_path: Path, clean: RunResult
) -> None:
    store = tmp_path / "store"
    first = run(store)
    assert first.outputs == clean.outputs
    blocks = sorted(store.glob("*/*.blk"))
    assert blocks
    for blk in blocks:  # once raised IsADirectoryError in the node's reader thread
        blk.unlink()
        blk.mkdir()
    again = run(store)
    assert again.outputs == clean.outputs
    assert again.store_counters()["num_unreadable"] > 0


def test_run_on_a_full_disk_prints_and_exports_the_count(
    tmpfs: Mount, capfd: pytest.CaptureFixture[str]
) -> None:
    store = tmpfs(FULL_DISK_BYTES)
    code = main(["run", "--mode", "dualpath", "--launch", "thread", "--agents", "2",
                 "--max-len", "400", "--gen-scale", "0.02", "--decode-nodes", "1",
                 "--engines-per-node", "1", "--buffer-mib", "16", "--hbm-mib", "32",
                 "--store", str(store), "--json"])
    out, err = capfd.readouterr()
    assert code == 0, err
    n = json.loads(out)["dualpath"]["unpersisted_blocks"]
    assert n > 0
    assert f"warning: dualpath: {n} KV blocks could not be persisted" in err
    assert "No space left on device" in err  # the node says why, once


def test_a_server_on_a_full_disk_keeps_serving_and_says_so(tmpfs: Mount) -> None:
    cfg = RunConfig(mode="dualpath", store_root=str(tmpfs(FULL_DISK_BYTES) / "store"),
                    launch="thread", num_prefill_nodes=1, num_decode_nodes=1,
                    engines_per_node=1, buffer_bytes=8 * MiB, hbm_bytes=16 * MiB,
                    transfer_kind="shm")
    logs: list[str] = []
    with ServingEngine(cfg, model_tokenizer(ModelSource("tiny")), "tiny", 60, max_restarts=0,
                       log=logs.append) as engine:
        for k in range(3):
            prompt = tuple(range(1 + k, 400 + k))  # six blocks each: more than the disk holds
            fin = engine.generate(GenerateRequest(prompt, SamplingParams(
                max_tokens=4, temperature=0.0, is_ignore_eos=True))).result()
            assert len(fin.output_ids) == 4
        assert engine.is_healthy and engine.num_restarts == 0
        n = engine.num_unpersisted_blocks
        assert n > 0
        assert any("KV blocks could not be persisted" in m for m in logs), logs
