"""GPU cost model: hand-checked terms, monotonicity, DSA caps and the coefficient file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dualpath.core.hardware import hardware_preset
from dualpath.core.model import dense_gqa_spec, model_preset
from dualpath.sched.cost import (
    CostCoefficients,
    CostFileError,
    allreduce_time_s,
    coefficients_for,
    decode_kv_read_bytes,
    decode_step_time_s,
    default_cost_file,
    kv_room_bytes,
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


# -- tensor parallelism -----------------------------------------------------------------------

H200 = hardware_preset("h200")
LLAMA70 = dense_gqa_spec("llama-70b", hidden=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                         head_dim=128, intermediate=28672, vocab_size=128256, kv_dtype_bytes=2,
                         weight_dtype_bytes=2)


def test_a_tensor_parallel_engine_shards_the_weights_and_pays_two_allreduces_per_layer() -> None:
    c = dataclasses.replace(UNIT, allreduce_latency_s=2e-5, allreduce_efficiency=0.5)
    one, eight = H200, H200.engine_view(8)
    # Compute and memory scale with the engine's GPUs; the all-reduces come on top.
    ar = 2 * 80 * (2e-5 + 64 * 8192 * 2 * 2 * 7 / 8 / (0.5 * H200.nvlink_bytes_per_s))
    assert allreduce_time_s(LLAMA70, eight, 64, c) == pytest.approx(ar)
    assert allreduce_time_s(LLAMA70, one, 64, c) == 0.0
    assert decode_step_time_s(LLAMA70, eight, 64, 64 * 4096, c) == pytest.approx(
        decode_step_time_s(LLAMA70, one, 64, 64 * 4096, c) / 8 + ar)
    assert prefill_ffn_time_s(LLAMA70, eight, 64, c) == pytest.approx(
        prefill_ffn_time_s(LLAMA70, one, 64, c) / 8 + ar)
    assert prefill_ffn_time_s(LLAMA70, eight, 0, c) == 0.0
    # 141 GB of BF16 weights leave one 141 GB GPU nothing; eight of them hold the rest.
    assert kv_room_bytes(LLAMA70, one, 0.1, 1) == 0.0
    assert kv_room_bytes(LLAMA70, eight, 0.1, 1) == pytest.approx(
        8 * H200.hbm_bytes * 0.9 - LLAMA70.weight_bytes)


def test_kv_heads_fewer_than_gpus_are_held_on_several_and_read_by_each() -> None:
    m = model_preset("smollm2-135m")  # 3 KV heads, 9 heads
    nine = hardware_preset("dgx-h100").with_overrides(gpus_per_node=9).engine_view(9)
    assert m.kv_replicas(9) == 3 and m.kv_replicas(1) == 1
    assert decode_kv_read_bytes(m, 1, 100, 9) == 3 * decode_kv_read_bytes(m, 1, 100)
    room = nine.hbm_bytes * 0.9 - m.weight_bytes
    assert kv_room_bytes(m, nine, 0.1, 1) == pytest.approx(room / 3)
    mla = model_preset("ds-27b")
    assert mla.kv_replicas(4) == 4  # the latent serves every head: every GPU holds it
