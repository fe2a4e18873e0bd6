import json
from pathlib import Path

import pytest

from dualpath.cli.main import main

CONFIGS = Path(__file__).parent.parent / "fixtures" / "configs"


def test_analyze_paper_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "analyze",
                "--hardware",
                "h800-deepseek",
                "--prefill-nodes",
                "2",
                "--decode-nodes",
                "4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "1/7 (0.143)" in out and "= 7/2 (3.5)" in out
    assert "inside the range" in out


def test_analyze_dgx_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "--hardware", "dgx-h100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["range"]["lower"] == pytest.approx(1 / 3)
    assert data["range"]["upper"] == pytest.approx(1.0)
    assert data["inside_range"] is True  # 2P4D = 0.5


def test_analyze_model_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "--model-config", str(CONFIGS / "qwen2-0.5b.json"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_bytes_per_token"] == 2 * 2 * 64 * 24 * 2


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--hardware", "tpu"], "unknown hardware preset 'tpu'"),
        (["--model", "gpt"], "unknown model preset 'gpt'"),
        (["--storage-nic-gb-per-s", "1000"], "storage_nic_bytes_per_s"),
        (["--compute-nic-gb-per-s", "0"], "compute_nic_bytes_per_s=0.0"),
        (["--dram-gb-per-s", "-3"], "dram_bytes_per_s"),
        (["--kv-dtype-bytes", "2"], "--kv-dtype-bytes=2: applies to --model-config only"),
        (["--model-config", str(CONFIGS / "qwen2-0.5b.json"), "--kv-dtype-bytes", "3"],
         "--kv-dtype-bytes=3: must be 1 (FP8), 2 (FP16/BF16) or 4 (FP32)"),
        (["--tensor-parallel-size", "3"], "tensor_parallel_size=3: must divide the 8 GPUs"),
        (["--hit-ratio", "0.9"], "--hit-ratio, --append-tokens and --gen-tokens go together"),
        (["--prefill-nodes", "0"], "num_prefill_nodes=0"),
        (["--model-config", str(CONFIGS / "malformed.json")], "invalid JSON"),
        (["--model-config", str(CONFIGS / "unsupported.json")], "not supported"),
    ],
)
def test_bad_input_is_one_line_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["analyze", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(("argv", "needle"), [
    (["--storage-nic-gbps", "100"], "--storage-nic-gbps: renamed --storage-nic-gb-per-s"),
    (["--dram-gbps", "400"], "--dram-gbps: renamed --dram-gb-per-s"),
    (["--pd", "1P2D"], "--pd: analyze takes one P/D: --prefill-nodes P --decode-nodes D"),
])
def test_old_and_foreign_flags_name_the_right_one(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as ex:
        main(["analyze", *argv])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dualpath analyze: error: {needle}") and err.count("\n") == 1


LLAMA_70B = ["--model-config", str(CONFIGS / "llama-70b.json"), "--hardware", "h200",
             "--tensor-parallel-size", "8", "--prefill-nodes", "1", "--decode-nodes", "2"]


def test_a_dense_70b_on_tp8_h200_nodes_is_storage_bound_with_one_path(
    capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["analyze", *LLAMA_70B, "--agents", "8"]) == 0
    out = capsys.readouterr().out
    assert "Is 1P2D TP8 storage-bound?" in out and "DualPath is worth it here" in out
    assert "g = 1 engines/node of 8 GPUs each (TP 8), B = 400 GB/s per engine" in out
    assert "h200 has no calibrated storage record, so this is an upper bound" in out
    # A slower storage system (half the line rate) only deepens the one-path bound.
    assert main(["analyze", *LLAMA_70B, "--agents", "8", "--storage-read", "flat:0.5",
                 "--json"]) == 0
    bound = json.loads(capsys.readouterr().out)["storage_bound"]
    assert bound["one_path"]["binding"] == "storage" and bound["gain"] > 1.5
    assert bound["is_line_rate"] is False


def test_a_workload_without_reuse_gains_nothing_from_a_second_read_path(
    capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["analyze", *LLAMA_70B, "--hit-ratio", "0", "--append-tokens", "4000",
                 "--gen-tokens", "300", "--json"]) == 0
    bound = json.loads(capsys.readouterr().out)["storage_bound"]
    assert bound["gain"] == pytest.approx(1.0) and bound["one_path"]["binding"] != "storage"
    assert bound["verdict"].startswith("DualPath gains little here")


def test_help_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ex:
        main(["--help"])
    assert ex.value.code == 0
    assert "analyze" in capsys.readouterr().out
