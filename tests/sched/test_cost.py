"""GPU cost model: hand-checked terms, monotonicity, DSA caps and the coefficient file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dualpath.core.hardware import hardware_preset
from dualpath.core.model import model_preset
from dualpath.sched.cost import (
    CostCoefficients,
    CostFileError,
    coefficients_for,
    decode_kv_read_bytes,
    decode_step_time_s,
    default_cost_file,
    load_cost_coefficients,
    prefill_attention_time_s,
    prefill_ffn_time_s,
)

H800 = hardware_preset("h800-deepseek")
UNIT = CostCoefficients(attention_efficiency=1.0, linear_efficiency=1.0,
                        decode_hbm_efficiency=1.0, per_layer_overhead_s=0.0,
                        per_step_overhead_s=0.0, moe_layer_overhead_s=0.0, is_fp8_linear=False,
                        source="test")


def test_prefill_attention_is_flops_over_peak_at_unit_efficiency() -> None:
    m = model_preset("qwen2.5-32b")
    t = prefill_attention_time_s(m, H800, [(1000, 100), (0, 50)], UNIT)
    flops = (m.prefill_attention_flops(1000, 100) + m.prefill_attention_flops(0, 50)
             + 150 * m.attn_linear_flops_per_token)
    assert t == pytest.approx(flops / H800.gpu_bf16_flops_per_s)
    slower = dataclasses.replace(UNIT, attention_efficiency=0.5, per_layer_overhead_s=1e-5)
    t2 = prefill_attention_time_s(m, H800, [(1000, 100), (0, 50)], slower)
    assert t2 > t
    assert prefill_attention_time_s(m, H800, [], slower) == pytest.approx(64 * 1e-5)


def test_attention_time_grows_with_context_and_chunk() -> None:
    m = model_preset("deepseek-v3.2")
    c = coefficients_for(m, H800)
    times = [prefill_attention_time_s(m, H800, [(ctx, 512)], c) for ctx in (0, 4096, 65536)]
    assert times[0] < times[1] < times[2]
    chunks = [prefill_attention_time_s(m, H800, [(1000, b)], c) for b in (1, 64, 4096)]
    assert chunks[0] < chunks[1] < chunks[2]


def test_ffn_uses_fp8_peak_and_moe_overhead() -> None:
    m = model_preset("deepseek-v3.2")
    fp8 = dataclasses.replace(UNIT, is_fp8_linear=True, moe_layer_overhead_s=1e-4)
    t = prefill_ffn_time_s(m, H800, 1000, fp8)
    assert t == pytest.approx(1000 * m.ffn_flops_per_token / H800.gpu_fp8_flops_per_s
                              + 61 * 1e-4)
    assert prefill_ffn_time_s(model_preset("qwen2.5-32b"), H800, 0, fp8) == 0.0


def test_decode_reads_weights_share_and_capped_dsa_kv() -> None:
    m = model_preset("deepseek-v3.2")
    # Indexer keys (132 B/layer) for every token; main KV (656 B/layer) for top-k of them.
    assert decode_kv_read_bytes(m, 1, 100_000) == pytest.approx(61 * (132 * 100_000 + 656 * 2048))
    assert decode_kv_read_bytes(m, 1, 1000) == pytest.approx(61 * 788 * 1000)
    dense = model_preset("qwen2.5-32b")
    assert decode_kv_read_bytes(dense, 4, 1000) == dense.kv_bytes_per_token * 1000
    t = decode_step_time_s(dense, H800, 1, 1000, UNIT)
    memory = (dense.weight_bytes + dense.kv_bytes_per_token * 1000) / H800.hbm_bytes_per_s
    assert t == pytest.approx(memory)  # batch 1 is memory bound
    assert decode_step_time_s(dense, H800, 0, 0, UNIT) == 0.0
    c = coefficients_for(m, H800)
    assert decode_step_time_s(m, H800, 64, 64 * 30_000, c) > decode_step_time_s(
        m, H800, 8, 8 * 30_000, c)


def test_packaged_file_has_a_source_on_every_entry_and_a_default() -> None:
    doc = json.loads(default_cost_file().read_text())
    assert all(e["source"] for e in doc["entries"])
    assert any(e["model"] == "*" and e["hardware"] == "*" for e in doc["entries"])
    assert load_cost_coefficients("no-such-model", "no-such-hw").source
    assert coefficients_for(model_preset("deepseek-v3.2"), H800).is_fp8_linear


def _write(tmp_path: Path, entries: list[dict[str, object]]) -> Path:
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"entries": entries}, indent=1))
    return p


def test_lookup_order_and_errors_name_file_and_field(tmp_path: Path) -> None:
    base = {k: v for k, v in dataclasses.asdict(UNIT).items()}
    p = _write(tmp_path, [
        {"model": "*", "hardware": "*", **base},
        {"model": "m", "hardware": "*", **{**base, "attention_efficiency": 0.5}},
        {"model": "m", "hardware": "h", **{**base, "attention_efficiency": 0.25}},
    ])
    assert load_cost_coefficients("m", "h", p).attention_efficiency == 0.25
    assert load_cost_coefficients("m", "x", p).attention_efficiency == 0.5
    assert load_cost_coefficients("z", "x", p).attention_efficiency == 1.0
    bad = _write(tmp_path, [{"model": "*", "hardware": "*", **{**base, "linear_efficiency": 2}}])
    with pytest.raises(CostFileError, match=r"c\.json:\d+: .*linear_efficiency=2"):
        load_cost_coefficients("m", "h", bad)
    full = _write(tmp_path, [{"model": "*", "hardware": "*",
                              **{**base, "hbm_reserve_fraction": 1.0}}])
    with pytest.raises(CostFileError, match=r"c\.json:\d+: .*hbm_reserve_fraction=1"):
        load_cost_coefficients("m", "h", full)
    for cap in (-1, 2.5, True):
        capped = _write(tmp_path, [{"model": "*", "hardware": "*",
                                    **{**base, "max_seqs_per_decode_engine": cap}}])
        with pytest.raises(CostFileError, match=r"c\.json:\d+: .*max_seqs_per_decode_engine"):
            load_cost_coefficients("m", "h", capped)
    unknown = _write(tmp_path, [{"model": "*", "hardware": "*", **base, "speed": 1}])
    with pytest.raises(CostFileError, match="unknown field.*speed"):
        load_cost_coefficients("m", "h", unknown)
    broken = tmp_path / "broken.json"
    broken.write_text('{"entries": [\n  {"model": }\n]}')
    with pytest.raises(CostFileError, match=r"broken\.json:2: invalid JSON"):
        load_cost_coefficients("m", "h", broken)
    with pytest.raises(CostFileError, match="cannot read"):
        load_cost_coefficients("m", "h", tmp_path / "missing.json")
