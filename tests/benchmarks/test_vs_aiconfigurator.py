"""`benchmarks/compare/vs_aiconfigurator.py` offline: its parser on a real AIConfigurator 0.12.0
output (tests/fixtures), the storage arithmetic, and the config.json it writes for AIConfigurator
against our model registry. AIConfigurator itself is not installed by `make test`."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

from dualpath.core.hf_config import model_from_hf_config
from dualpath.core.model import model_preset

ROOT = Path(__file__).resolve().parents[2]
OUTPUT = ROOT / "tests" / "fixtures" / "aiconfigurator-0.12.0-qwen2.5-32b-h200.txt"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "vs_aiconfigurator", ROOT / "benchmarks" / "compare" / "vs_aiconfigurator.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


vs = _load()


def test_the_best_agg_and_disagg_rows_are_read_from_a_real_output() -> None:
    got = vs.parse_aic(OUTPUT.read_text(encoding="utf-8"))
    assert set(got) == {"agg", "disagg"}
    agg, dis = got["agg"], got["disagg"]
    assert (agg.tokens_per_s_per_gpu, agg.requests_per_s, agg.ttft_ms) == (286.58, 11.49,
                                                                            252.39)
    assert (agg.total_gpus, agg.prefill_gpus, agg.layout) == (16, 16, "tp8pp1 x 2")
    assert (dis.tokens_per_s_per_gpu, dis.requests_per_s, dis.ttft_ms) == (251.30, 10.05,
                                                                            587.19)
    assert (dis.total_gpus, dis.prefill_gpus) == (16, 4)
    assert dis.layout == "4 prefill tp1pp1 + 3 decode tp4pp1"
    # Columns read from the right places agree with each other: output tokens/s over the
    # cluster = requests/s x 400 output tokens (AIConfigurator rounds each to 2 decimals).
    for c in (agg, dis):
        assert c.tokens_per_s_per_gpu * c.total_gpus == pytest.approx(c.requests_per_s * 400,
                                                                      rel=0.01)


def test_every_row_of_both_tables_is_kept_with_its_header() -> None:
    tables = vs.parse_tables(OUTPUT.read_text(encoding="utf-8"))
    assert [r["Rank"] for r in tables["agg"]] == ["1", "2", "3", "4"]
    assert [r["(p)workers"] for r in tables["disagg"]] == ["4", "2", "8", "3"]


def test_output_without_tables_or_columns_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="no 'agg/disagg Top Configurations' table"):
        vs.parse_aic("Loading AIConfigurator version: 0.12.0\n")
    text = ("agg Top Configurations: (Ranked by tokens/s/gpu)\n+---+---+\n| Rank | req/s |\n"
            "+---+---+\n| 1 | 3.0 |\n+---+---+\n")
    with pytest.raises(ValueError, match="agg table has no column 'total_gpus \\(used\\)'"):
        vs.parse_aic(text)


def test_storage_need_is_rate_times_prefix_kv_over_the_reading_nodes() -> None:
    kv = model_preset("qwen2.5-32b").kv_bytes_per_token
    assert kv == 262_144  # 2 x 8 KV heads x 128 x 2 B x 64 layers
    agg = vs.AicConfig("agg", 286.58, 11.49, 252.39, 16, 16, "tp8pp1 x 2")
    need = vs.storage_need(agg, 30_000, kv, 8)
    assert need.read_bytes_per_s == pytest.approx(11.49 * 30_000 * 262_144)
    assert need.num_reading_nodes == 2
    assert need.per_node_bytes_per_s == pytest.approx(45.18e9, rel=1e-3)
    # Disaggregated: only the prefill workers' nodes read; 4 GPUs fill one node, 9 two.
    dis = vs.AicConfig("disagg", 251.3, 10.05, 587.19, 16, 4, "")
    assert vs.storage_need(dis, 30_000, kv, 8).num_reading_nodes == 1
    assert vs.storage_need(vs.AicConfig("disagg", 1, 1, 1, 16, 9, ""), 1, kv,
                           8).num_reading_nodes == 2
    with pytest.raises(ValueError):
        vs.storage_need(agg, 30_000, 0.0, 8)


def test_the_config_given_to_aiconfigurator_is_our_registrys_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(vs.QWEN25_32B_CONFIG))
    spec = model_from_hf_config(tmp_path)
    preset = model_preset("qwen2.5-32b")
    assert spec.kv_bytes_per_token == preset.kv_bytes_per_token
    assert spec.num_layers == preset.num_layers
    assert math.isclose(spec.attn_linear_params_per_layer, preset.attn_linear_params_per_layer)
    assert vs.QWEN25_32B_CONFIG["architectures"] == ["Qwen2ForCausalLM"]
