import json
from pathlib import Path

import pytest

from dualpath.cli.main import main
from dualpath.workload.jsonl import load_trajectories

FIXTURE = Path(__file__).parent.parent / "fixtures" / "mooncake_excerpt.jsonl"


def test_generate_then_stats_64k(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.jsonl"
    assert main(["trace", "generate", "--preset", "64k", "--seed", "0", "--out", str(out)]) == 0
    tf = load_trajectories(out)
    assert len(tf.trajectories) == 500 and tf.max_len_tokens == 65536
    assert tf.meta["preset"] == "64k" and tf.meta["seed"] == 0
    png = tmp_path / "h.png"
    assert main(["trace", "stats", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "paper 64K" in text and "deviation" in text and "Measured hit rate" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["trace", "stats", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    for key, want in (("turns", 157), ("append_tokens", 429), ("gen_tokens", 176),
                      ("total_tokens", 55958), ("context_tokens", 32721)):
        assert d[key] == pytest.approx(want, rel=0.05), key
    assert d["paper_hit_rate"] == pytest.approx(0.987, abs=0.002)
    assert d["compare"]["label"] == "paper 64K" and d["compare"]["turns"] == 157


def test_generate_to_stdout_with_replay_options(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["trace", "generate", "--preset", "32k", "--num-trajectories", "20",
            "--append-scale", "2", "--mal", "20000", "--num-agents", "30"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    header = json.loads(lines[0])
    assert header["format"] == "dualpath-trajectories" and header["meta"]["append_scale"] == 2
    trajs = [json.loads(line) for line in lines[1:]]
    assert len(trajs) == 30
    totals = [sum(t["append_tokens"]) + sum(t["gen_tokens"]) for t in trajs]
    assert max(totals[:20]) <= 20000
    assert all(t["append_tokens"][0] == 64 and t["gen_tokens"][0] == 1 for t in trajs[20:])


def test_stats_mooncake_and_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "stats", str(FIXTURE)]) == 0
    assert "200 requests" in capsys.readouterr().out
    assert main(["trace", "stats", str(FIXTURE), "--json", "--plot", str(tmp_path / "m.png")]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["format"] == "mooncake" and d["num_requests"] == 200
    assert (tmp_path / "m.png").exists()
    out = tmp_path / "conv.jsonl"
    assert main(["trace", "convert", str(FIXTURE), "--out", str(out)]) == 0
    tf = load_trajectories(out)
    assert sum(t.num_turns for t in tf.trajectories) == 200
    assert main(["trace", "stats", str(out), "--format", "trajectories"]) == 0
    assert "trajectories" in capsys.readouterr().out


def test_user_errors_exit_2_with_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n'
                   '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": []}\n')
    assert main(["trace", "stats", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: field 'hash_ids'" in err and len(err.strip().splitlines()) == 1
    assert main(["trace", "generate", "--preset", "128k"]) == 2
    assert "valid: 32k, 48k, 64k" in capsys.readouterr().err
    bad.write_text("hello\n")
    assert main(["trace", "stats", str(bad)]) == 2
    assert "--format" in capsys.readouterr().err
    assert main(["trace", "stats", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_generate_fit_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "f.jsonl"
    args = ["trace", "generate", "--fit", "16384,40,500,150,14000,8000", "--num-trajectories",
            "40", "--fit-iterations", "5", "--out", str(out)]
    assert main(args) == 0
    tf = load_trajectories(out)
    assert tf.meta["fit_target"]["max_len_tokens"] == 16384 and tf.max_len_tokens == 16384
    assert tf.meta["params"]["max_len_tokens"] == 16384
    assert main(["trace", "stats", str(out)]) == 0
    assert "fit target" in capsys.readouterr().out
    assert main(["trace", "generate", "--fit", "100,2,3,4,500,6"]) == 2
    assert "TOTAL and CONTEXT" in capsys.readouterr().err


GOOD_REQUEST = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}'
TRACE_READERS = (["trace", "stats"], ["trace", "convert"],
                 ["simulate", "--agents", "1", "--no-progress", "--mooncake"])


@pytest.mark.parametrize("argv", TRACE_READERS)
def test_deeply_nested_json_names_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    path = tmp_path / "nested.jsonl"
    path.write_text(GOOD_REQUEST + '\n{"hash_ids": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    assert main([*argv, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith(f"{path}:2: too deeply nested"), err


def test_a_deeply_nested_model_config_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert main(["simulate", "--agents", "1", "--model-config", str(path)]) == 2
    assert capsys.readouterr().err.strip().endswith(f"{path}: too deeply nested")


@pytest.mark.parametrize("argv", [*TRACE_READERS, ["run", "--trajectories"]])
def test_an_empty_file_is_the_same_error_for_every_reader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n")
    assert main([*argv, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith(f"{path}: empty") and len(err.strip().splitlines()) == 1, err
