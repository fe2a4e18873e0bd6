import csv
import math
from itertools import pairwise
from pathlib import Path

import pytest

from dualpath.core.model import model_preset
from dualpath.plan.section import Context
from dualpath.reproduce.checks import (
    PAPER_FIG3,
    PAPER_TABLE1,
    cache_compute_ratio,
    fig3,
    fit_fixed_over_var,
    paper_relative,
    relative_throughput,
    table1,
)
from dualpath.reproduce.registry import resolve


def test_fixed_over_var_fit_recovers_a_curve_it_generated() -> None:
    points = {b: relative_throughput(1.5, b) for b in (1, 2, 4, 8, 16)}
    assert fit_fixed_over_var(points) == pytest.approx(1.5, rel=1e-4)
    assert relative_throughput(1.5, 1) == 1.0
    assert relative_throughput(0.0, 7) == 1.0  # no fixed cost: batching gains nothing


def test_paper_curve_interpolates_and_is_flat_past_its_last_point() -> None:
    assert paper_relative(1) == 1.0
    assert paper_relative(4) == pytest.approx((2.1 + 2.6) / 2)
    assert paper_relative(100) == PAPER_FIG3[20]


def test_fig3_section_compares_the_cost_model_with_the_paper(tmp_path: Path) -> None:
    sec = fig3(Context(tmp_path, setups=("ds660b_2p4d",)))
    with open(tmp_path / "fig3_batching.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    rel = {int(r["batch_requests"]): float(r["relative_throughput"]) for r in rows}
    assert rel[1] == 1.0
    # More requests per pass never lower token throughput, and a fixed cost makes it rise.
    values = [rel[b] for b in sorted(rel)]
    assert all(a <= b for a, b in pairwise(values))
    assert values[-1] > 1.0
    passes = [float(r["pass_ms"]) for r in rows]
    assert all(math.isfinite(p) and p > 0 for p in passes)
    assert rows[0]["paper_relative_throughput"] == "1"
    assert "| paper | 1.0x | 1.7x" in sec.body
    assert (tmp_path / "fig3_batching.png").stat().st_size > 0
    assert resolve(["fig3"]) == ["fig3"]


def test_cache_compute_ratio_reproduces_table1_for_the_dense_model() -> None:
    # Qwen2.5-32B has one KV format (FP16), so it checks the FLOPs count: within 2% at both ends.
    qwen = model_preset("qwen2.5-32b")
    lo, hi = PAPER_TABLE1["qwen2.5-32b"]
    assert cache_compute_ratio(qwen, 16 * 1024) == pytest.approx(lo, rel=0.02)
    assert cache_compute_ratio(qwen, 64 * 1024) == pytest.approx(hi, rel=0.02)
    # More context per appended token: more KV per FLOP.
    v32 = model_preset("deepseek-v3.2")
    assert cache_compute_ratio(v32, 16 * 1024) < cache_compute_ratio(v32, 64 * 1024)


def test_table1_section_states_the_kv_size_the_paper_implies(tmp_path: Path) -> None:
    sec = table1(Context(tmp_path))
    assert "| qwen2.5-32b | 4,096 B |" in sec.body
    with open(tmp_path / "table1_cache_compute.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert {r["model"] for r in rows} == set(PAPER_TABLE1)
    implied = sec.body.split("deepseek-v3.2 ")[-1].split(" B per token")[0]
    assert 500 < float(implied.replace(",", "")) < 650  # the paper's FP8 576-dim latent
    assert resolve(["table1"]) == ["table1"]
