"""`dualpath simulate` end to end on a tiny cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.cli.main import main

TINY = ["simulate", "--model", "ds-27b", "--prefill-nodes", "1", "--decode-nodes", "1",
        "--trace", "32k", "--agents", "3", "--mal", "3000", "--no-progress"]


def test_json_summaries_side_by_side(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    csv = tmp_path / "req.csv"
    assert main([*TINY, "--mode", "basic,oracle", "--json", "--csv", str(csv)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["basic", "oracle"]
    assert out["oracle"]["jct_s"] <= out["basic"]["jct_s"]
    assert out["basic"]["num_completed"] == out["basic"]["num_requests"] > 0
    rows = (tmp_path / "req.basic.csv").read_text().splitlines()
    assert rows[0].startswith("request_id,agent,row,prompt_tokens")
    assert len(rows) == 1 + out["basic"]["num_requests"]


def test_table_and_mooncake_replay(capsys: pytest.CaptureFixture[str]) -> None:
    trace = Path(__file__).parent.parent / "fixtures" / "mooncake_excerpt.jsonl"
    assert main([*TINY, "--mode", "dualpath", "--mooncake", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "dualpath" in out and "JCT s" in out


def test_unknown_mode_is_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY, "--mode", "fast"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown mode preset 'fast'" in err[0]


def test_read_disciplines_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    runs = {}
    for name, flags in (("default", []), ("fifo", ["--pe-reads", "fifo", "--de-reads", "fifo"]),
                        ("shared", ["--pe-reads", "shared:2"])):
        # 16 agents on a slow storage NIC: reads queue behind each other.
        assert main([*TINY, "--agents", "16", "--storage-nic-gb-per-s", "0.5", "--mode", "basic",
                     "--json", *flags]) == 0
        runs[name] = json.loads(capsys.readouterr().out)["basic"]
    assert runs["fifo"] == runs["default"]
    assert runs["shared"]["num_completed"] == runs["default"]["num_completed"]
    assert runs["shared"] != runs["default"]
    assert main([*TINY, "--pe-reads", "shared:x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max_in_flight" in err[0]


def test_dram_buffer_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A node whose buffer holds one read at a time starts its next read only once the step
    that used the last one has run: reads no longer overlap compute."""
    jct = {}
    for gb in ("80", "0.001"):
        assert main([*TINY, "--agents", "16", "--storage-nic-gb-per-s", "0.5", "--mode", "basic",
                     "--dram-buffer-gb", gb, "--json"]) == 0
        jct[gb] = json.loads(capsys.readouterr().out)["basic"]["jct_s"]
    assert jct["0.001"] > jct["80"]
    assert main([*TINY, "--dram-buffer-gb", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dram_buffer_bytes" in err[0]


def test_read_side_choices_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    small = [*TINY, "--decode-nodes", "2", "--agents", "16", "--mode", "dual-path,dualpath",
             "--json"]
    runs = {}
    for name, flags in (("default", []),
                        ("explicit", ["--read-tie-side", "balanced", "--rr-read-side", "random"]),
                        ("other", ["--read-tie-side", "pe", "--rr-read-side", "queue"])):
        assert main([*small, *flags]) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    assert runs["explicit"] == runs["default"]  # the flags' defaults are the scheduler's
    assert runs["other"]["dual-path"] != runs["default"]["dual-path"]
    assert runs["other"]["dual-path"]["num_completed"] == runs["default"]["dual-path"][
        "num_completed"]
    with pytest.raises(SystemExit):
        main([*small, "--rr-read-side", "alternate"])


def test_storage_read_model_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    """--storage-read picks the storage NICs' read model and says what rate it gives this
    model's Full Blocks; a slower read model gives a Basic run (which only reads) a longer
    JCT; a bad value is one line quoting it."""
    jct, lines = {}, {}
    for spec in ("calibrated", "nominal", "flat:0.2", "queued:4"):
        assert main([*TINY, "--agents", "8", "--storage-nic-gb-per-s", "2", "--mode", "basic",
                     "--storage-read", spec]) == 0
        out = capsys.readouterr()
        lines[spec] = next(x for x in out.err.splitlines() if x.startswith("storage reads"))
        jct[spec] = float(next(x for x in out.out.splitlines()
                               if x.strip().startswith("basic")).split()[2])
    assert "calibrated, flat: read efficiency 0.538" in lines["calibrated"]
    assert "1.000 of the 2 GB/s line rate" in lines["nominal"]
    assert "0.200 of the 2 GB/s line rate" in lines["flat:0.2"]
    assert "queued: 4.0 reads in flight" in lines["queued:4"]
    assert jct["nominal"] < jct["calibrated"] < jct["flat:0.2"]
    assert main([*TINY, "--storage-read", "queued:many"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--storage-read 'queued:many'" in err[0]


def test_calibrated_rate_notes_a_far_block_size(capsys: pytest.CaptureFixture[str]) -> None:
    """The calibrated flat rate was fitted on DS 27B's Full Blocks: a model whose blocks are
    12x larger is told what the queued form gives them; DS 27B itself is not."""
    assert main([*TINY, "--mode", "basic"]) == 0
    assert "note:" not in capsys.readouterr().err
    qwen = [*TINY, "--mode", "basic"]
    qwen[qwen.index("ds-27b")] = "qwen2.5-32b"
    assert main(qwen) == 0
    err = capsys.readouterr().err.splitlines()
    at = next(i for i, x in enumerate(err) if x.startswith("storage reads"))
    assert err[at + 1].startswith("note: the calibrated rate was fitted on 1.39 MB Full Blocks")
    assert "`--storage-read queued`" in err[at + 1] and "12.1x" in err[at + 1]


def test_online_rows_say_why_each_run_stopped_and_its_latencies_against_the_slo(
    capsys: pytest.CaptureFixture[str]
) -> None:
    """On a slow storage NIC basic overloads (a TTFT past 4 s stops it early) while dualpath
    runs its whole duration: the rows say so, count each run's own completed turns and give
    no JCT ratio."""
    argv = [*TINY, "--agents", "200", "--storage-nic-gb-per-s", "0.1", "--online-aps", "3",
            "--max-duration", "60", "--mode", "basic,dualpath"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()
            if line.strip().startswith(("basic ", "dualpath ")) and " APS" not in line
            and "%" not in line}
    assert "FAIL  overloaded: a turn's TTFT passed the limit" in rows["basic"]
    assert "met  ran its full --max-duration" in rows["dualpath"]
    assert "JCT" not in out and "vs basic" not in out
    assert "SLO: mean TTFT <= 4 s and mean TPOT <= 50 ms" in out
    assert main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    for mode, line in rows.items():
        assert line.split()[4] == f"{summary[mode]['num_completed']:,}"
    assert summary["basic"]["stop_reason"] == "ttft_limit"


def test_flags_of_other_commands_and_old_spellings_name_the_right_one(
    capsys: pytest.CaptureFixture[str]
) -> None:
    for flags, needle in ((["--pd", "1P2D"], "--pd: simulate takes one P/D: --prefill-nodes P "
                           "--decode-nodes D"),
                          (["--storage-cluster-gbps", "10"], "renamed --storage-cluster-gb-per-s"),
                          (["--modes", "basic"], "simulate spells it --mode")):
        with pytest.raises(SystemExit) as ex:
            main([*TINY, *flags])
        err = capsys.readouterr().err
        assert ex.value.code == 2 and needle in err and err.count("\n") == 1
