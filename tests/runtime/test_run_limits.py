"""`dualpath run` and `serve` refuse what cannot run, up front and in one line: a model folder
whose config.json has wrong types, a cluster too large for one machine, zero engines."""

from __future__ import annotations

import glob
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dualpath.cli.commands.run import _config
from dualpath.cli.main import build_parser, main
from dualpath.core.errors import SpecError
from dualpath.runtime.model.weights import CheckpointError, config_from_hf

GOOD = {
    "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
}


@pytest.mark.parametrize("field, value", [
    ("hidden_size", "64"), ("num_attention_heads", 0), ("rms_norm_eps", "abc"),
    ("sliding_window", "x"), ("tie_word_embeddings", "false"), ("rope_theta", -1),
    ("bos_token_id", 1.5), ("max_position_embeddings", None),
])
def test_a_config_with_a_wrong_type_is_one_line_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: object
) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**GOOD, "model_type": "mistral",
                                                    field: value}))
    with pytest.raises(CheckpointError, match=field):
        config_from_hf(folder)
    # Both commands load the folder's config through config_from_hf.
    for argv in (["run", "--agents", "1"], ["serve", "--port", "0"]):
        assert main([*argv, "--model", str(folder)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and field in err, err


def test_a_deeply_nested_config_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CheckpointError, match="too deeply nested"):
        config_from_hf(tmp_path)


def run_config(*argv: str) -> object:
    args = build_parser().parse_args(["run", *argv])
    return _config(args, "dualpath", "/nonexistent-store")


@pytest.mark.parametrize("argv, field", [
    (("--prefill-nodes", "100000"), "num_prefill_nodes + num_decode_nodes"),
    (("--engines-per-node", "1000000"), "engines_per_node"),
    (("--block-size", "1000000000"), "block_size"),
    (("--engines-per-node", "0"), "engines_per_node"),  # once replaced by the preset's
])
def test_a_cluster_this_machine_cannot_run_is_refused_up_front(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], field: str
) -> None:
    with pytest.raises(SpecError, match=re.escape(f"run.{field}=")):
        run_config(*argv)
    assert main(["run", "--mode", "basic", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and field in err, err


def test_a_buffer_larger_than_the_machine_is_one_line_and_leaks_nothing() -> None:
    # A real process: the node processes' shared-memory segments, and the resource tracker's
    # complaints about them, are what used to come out.
    child = subprocess.Popen(
        [sys.executable, "-m", "dualpath.cli.main", "run", "--mode", "basic", "--agents", "1",
         "--buffer-mib", "99999999999"], stderr=subprocess.PIPE, text=True,
    )
    _, stderr = child.communicate(timeout=300)
    assert child.returncode == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "buffer_bytes" in lines[0] and "machine" in lines[0], stderr
    assert not glob.glob(f"/dev/shm/dp{child.pid % 100000}*")  # the nodes' segments
