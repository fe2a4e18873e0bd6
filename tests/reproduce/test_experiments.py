"""Each experiment, at a tiny size, writes its CSV, PNG and markdown; the CLI wires them up."""

from __future__ import annotations

import csv
from pathlib import Path

from dualpath.cli.main import main
from dualpath.plan.section import Context, section_markdown
from dualpath.reproduce.ablation import ablation
from dualpath.reproduce.extensions import split_reads, table3
from dualpath.reproduce.offline import fig7, fig8, fig9
from dualpath.reproduce.online import fig10_11
from dualpath.reproduce.registry import assemble_report, resolve, run_experiments


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_fig7_writes_csv_png_and_paper_side_by_side(tmp_path: Path) -> None:
    ctx = Context(tmp_path, is_quick=True, agents=(3,), mals=("32k",), setups=("ds27b_1p1d",))
    sec = fig7(ctx)
    rows = _rows(tmp_path / "fig7.csv")
    assert {r["mode"] for r in rows} == {"oracle", "dualpath", "basic"}
    assert all(float(r["sim_jct_s"]) > 0 for r in rows)
    assert all(r["paper_jct_s"] == "" for r in rows)  # no paper cell at 3 agents
    png = tmp_path / "fig7_ds27b_1p1d.png"
    assert png in sec.files and png.stat().st_size > 5000
    assert "| agents | MAL | Oracle |" in sec.body


def test_fig7_without_paper_values(tmp_path: Path) -> None:
    ctx = Context(tmp_path, is_quick=True, agents=(2,), mals=("32k",), setups=("qwen32b_1p2d",))
    fig7(ctx)
    assert len(_rows(tmp_path / "fig7.csv")) == 3


def test_report_assembles_sections_and_reuses_runs(tmp_path: Path) -> None:
    ctx = Context(tmp_path, is_quick=True, agents=(2,), mals=("32k",), setups=("ds27b_1p1d",))
    report = tmp_path / "report.md"
    sections = run_experiments(ctx, ["fig7", "fig8"], report, "test")
    assert [s.key for s in sections] == ["fig7", "fig8"]
    text = report.read_text()
    assert "## Fig. 7: offline JCT" in text and "## Fig. 8: P/D ratio" in text
    assert "![fig8](fig8.png)" in text
    # fig8's 1P1D points are fig7's runs: cached, not simulated twice.
    specs = [s for s, _ in ctx.runner.log]
    assert len(specs) == len(set(specs))
    assert sum(1 for s in specs if s.mode == "basic" and not s.num_prefill_nodes
               and s.storage is None) == 1
    # 1P1D shared, 1P1D at nominal storage (Fig. 7's column), 2P1D, 1P2D.
    assert sum(1 for s in specs if s.mode == "basic") == 4


def test_ablation_and_balance(tmp_path: Path) -> None:
    sec = ablation(Context(tmp_path, is_quick=True, agents=(2,)))
    rows = _rows(tmp_path / "fig12_ablation.csv")
    assert [r["mode"] for r in rows] == ["basic", "layerwise", "dual-path", "dualpath"]
    assert float(rows[0]["reduction_pct"]) == 0.0
    for f in ("fig13_snic_windows.png", "fig14_attention_first5pct.png"):
        assert (tmp_path / f) in sec.files
    windows = _rows(tmp_path / "fig13_snic_windows.csv")
    assert {r["mode"] for r in windows} == {"dual-path", "dualpath"}
    assert "node5_read_GBps" in windows[0]  # 2P4D: one column per machine
    assert "round robin" in sec.body and "engines that ran" in sec.body


def test_fig8_pd_ratios(tmp_path: Path) -> None:
    fig8(Context(tmp_path, is_quick=True, agents=(2,), mals=("32k",)))
    assert {r["pd"] for r in _rows(tmp_path / "fig8.csv")} == {"1P1D", "2P1D", "1P2D"}


def test_online_capacity_search(tmp_path: Path) -> None:
    ctx = Context(tmp_path, is_quick=True, setups=("ds27b_1p1d",), online_duration_s=40.0)
    sec = fig10_11(ctx)
    rows = _rows(tmp_path / "fig10_11.csv")
    assert {r["mode"] for r in rows} == {"basic", "dualpath"}
    assert (tmp_path / "fig10_ds27b_1p1d_ttft_s.png").exists()
    assert (tmp_path / "fig12_breakdown_ds27b_1p1d_dualpath.png").exists()
    assert "capacity (APS)" in sec.body


def test_resolve_aliases_and_errors() -> None:
    assert resolve(["fig13", "fig11", "fig7"]) == ["fig7", "fig12", "fig10"]
    assert resolve(["all"])[0] == "calibration"


def test_cli_reproduce_and_bad_names(tmp_path: Path) -> None:
    out = tmp_path / "o"
    code = main(["reproduce", "fig7", "--quick", "--quiet", "--setups", "ds27b_1p1d",
                 "--agents", "2", "--mal", "32k", "--out", str(out)])
    assert code == 0
    assert (out / "section_fig7.md").read_text().startswith("## Fig. 7")
    assert main(["reproduce", "fig99", "--out", str(out)]) == 2
    assert main(["reproduce", "fig7", "--mal", "99k", "--out", str(out)]) == 2
    assert main(["reproduce", "calibrate", "--quick", "--write", "--out", str(out)]) == 2
    assert main(["reproduce", "calibrate", "--start-cap", "-2", "--out", str(out)]) == 2
    assert main(["reproduce", "table3", "--scale-out", "1", "--out", str(out)]) == 2


def test_cli_advise(tmp_path: Path) -> None:
    assert main(["advise", "--pd", "1X1D"]) == 2
    code = main(["advise", "--model", "ds-27b", "--pd", "1P1D,1P2D", "--modes", "dualpath",
                 "--steps", "0", "--duration", "30", "--out", str(tmp_path)])
    assert code == 0
    rows = _rows(tmp_path / "advise.csv")
    assert {r["config"] for r in rows} == {"1P1D dualpath", "1P2D dualpath"}
    assert "Recommended" in (tmp_path / "section_advise.md").read_text()


def test_assemble_report_from_sections_and_full_runs(tmp_path: Path) -> None:
    out = tmp_path / "figures"
    ctx = Context(out, is_quick=True, agents=(2,), mals=("32k",), setups=("ds27b_1p1d",))
    report = tmp_path / "report.md"
    for s in run_experiments(ctx, ["fig7"], report, "test"):
        (out / f"section_{s.key}.md").write_text(section_markdown(s, out))
    full = out / "full" / "big"
    full.mkdir(parents=True)
    (full / "section_fig7.md").write_text("## Fig. 7: offline JCT\n\n![x](fig7_x.png)\n")
    rebuilt = assemble_report(out, tmp_path / "again.md").read_text()
    assert "![fig7_ds27b_1p1d](figures/fig7_ds27b_1p1d.png)" in rebuilt
    assert "## Separate run (full/big): Fig. 7: offline JCT" in rebuilt
    assert "](figures/full/big/fig7_x.png)" in rebuilt
    assert "Where we differ from the paper" in rebuilt
    # Hand-written analysis beside a section survives every rebuild, after its section.
    (full / "addendum_fig7.md").write_text("### What we checked\n\n![y](fig7_y.png)\n")
    (out / "addendum_fig7.md").write_text("### Checked at quick size too\n")
    rebuilt = assemble_report(out, tmp_path / "again.md").read_text()
    big = rebuilt.index("## Separate run (full/big): Fig. 7: offline JCT")
    assert rebuilt.index("### What we checked") > big
    assert "](figures/full/big/fig7_y.png)" in rebuilt
    assert rebuilt.index("### Checked at quick size too") < big
    run_experiments(ctx, ["fig7"], report, "test")  # a re-run keeps it as well
    assert "### Checked at quick size too" in report.read_text()


def test_fig9_table3_split_tiny(tmp_path: Path) -> None:
    ctx = Context(tmp_path, is_quick=True, agents=(2,), mals=("32k",),
                  setups=("ds27b_1p1d",), online_duration_s=30.0)
    fig9(ctx)
    kinds = {(r["kind"], r["factor"]) for r in _rows(tmp_path / "fig9.csv")}
    assert ("append", "1.5") in kinds and ("gen", "3") in kinds
    sec = table3(ctx)
    assert [r["cluster"] for r in _rows(tmp_path / "table3.csv")] == [
        "2P4D", "4P8D", "2P4D", "4P8D"]
    assert "large/small" in sec.body
    sec = split_reads(ctx)
    assert "**Verdict:**" in sec.body
    assert {r["driver"] for r in _rows(tmp_path / "split_reads.csv")} == {"offline", "online"}


def test_table3_scale_out_sets_the_large_cluster(tmp_path: Path) -> None:
    ctx = Context(tmp_path, is_quick=True, agents=(2,), online_duration_s=20.0, scale_out=3)
    sec = table3(ctx)
    rows = _rows(tmp_path / "table3.csv")
    assert [r["cluster"] for r in rows] == ["2P4D", "6P12D", "2P4D", "6P12D"]
    assert rows[1]["agents"] == "6"
    assert "k = 3" in sec.body
