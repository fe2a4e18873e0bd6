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
        (["--storage-nic-gbps", "1000"], "storage_nic_bytes_per_s"),
        (["--compute-nic-gbps", "0"], "compute_nic_bytes_per_s=0.0"),
        (["--dram-gbps", "-3"], "dram_bytes_per_s"),
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


def test_help_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ex:
        main(["--help"])
    assert ex.value.code == 0
    assert "analyze" in capsys.readouterr().out
