import json
from pathlib import Path

import pytest

from dualpath.core.errors import DualPathError, UnknownPresetError
from dualpath.core.hf_config import ConfigError, model_from_hf_config
from dualpath.core.model import (
    MODEL_PRESETS,
    AttentionKind,
    ModelSpec,
    model_preset,
)

CONFIGS = Path(__file__).parent.parent / "fixtures" / "configs"


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_every_preset_is_valid(name: str) -> None:
    m = model_preset(name)
    assert m.kv_bytes_per_token > 0
    assert m.source
    assert m.prefill_attention_flops(0, 100) > 0
    assert m.ffn_flops_per_token > 0


def test_kv_bytes_of_presets() -> None:
    assert model_preset("qwen2.5-32b").kv_bytes_per_token == 2 * 8 * 128 * 64 * 2 == 262_144
    assert model_preset("smollm2-135m").kv_bytes_per_token == 2 * 3 * 64 * 30 * 2 == 23_040
    v32 = model_preset("deepseek-v3.2")
    assert v32.kv_bytes_per_token_per_layer == 656 + 132
    assert v32.attention is AttentionKind.MLA_DSA and v32.dsa_top_k == 2048
    assert model_preset("ds-27b").num_layers == 30


def test_deepseek_v32_parameter_count_is_about_671b() -> None:
    # FP8 weights: one byte per parameter (embeddings + head included).
    assert 640e9 < model_preset("deepseek-v3.2").weight_bytes < 700e9
    assert 24e9 < model_preset("ds-27b").weight_bytes < 30e9


def test_dense_prefill_attention_flops_closed_form() -> None:
    m = model_preset("qwen2.5-32b")
    per_key = 2 * 40 * (128 + 128)
    # 3 new tokens after 10 cached: keys seen 11 + 12 + 13 = 36
    assert m.prefill_attention_flops(10, 3) == pytest.approx(64 * per_key * 36)
    assert m.prefill_attention_flops(10, 0) == 0.0


def test_dsa_caps_main_attention_at_top_k_but_indexer_scans_all() -> None:
    m = model_preset("deepseek-v3.2")
    per_key = 2 * 128 * (192 + 128)
    per_index_key = 2 * 64 * 128
    flops = m.prefill_attention_flops(10_000, 2)
    expected = 61 * (per_key * 2048 * 2 + per_index_key * (10_001 + 10_002))
    assert flops == pytest.approx(expected)
    # Mixed: keys from 2047 to 2050 -> 2047 + 2048 + 2048 + 2048
    mixed = m.prefill_attention_flops(2046, 4)
    idx = per_index_key * (2047 + 2048 + 2049 + 2050)
    assert mixed == pytest.approx(61 * (per_key * (2047 + 3 * 2048) + idx))


def test_qwen2_config_derives_kv_bytes() -> None:
    m = ModelSpec.from_hf_config(CONFIGS / "qwen2-0.5b.json")
    # 2 x kv_heads x head_dim x layers x dtype bytes
    assert m.kv_bytes_per_token == 2 * 2 * (896 // 14) * 24 * 2
    assert m.attention is AttentionKind.GQA


def test_llama_config_with_explicit_head_dim_and_fp32() -> None:
    m = ModelSpec.from_hf_config(CONFIGS / "llama-tiny-fp32.json")
    assert m.kv_bytes_per_token == 2 * 8 * 32 * 4 * 4
    assert m.attention is AttentionKind.MHA


def test_kv_dtype_override() -> None:
    m = ModelSpec.from_hf_config(CONFIGS / "qwen2-0.5b.json", kv_dtype_bytes=1)
    assert m.kv_bytes_per_token == 2 * 2 * 64 * 24


def test_deepseek_config_matches_preset() -> None:
    bf16 = ModelSpec.from_hf_config(CONFIGS / "deepseek-v32-like.json")
    assert bf16.kv_bytes_per_token_per_layer == (512 + 64) * 2 + 132
    fp8 = ModelSpec.from_hf_config(CONFIGS / "deepseek-v32-like.json", kv_dtype_bytes=1)
    preset = model_preset("deepseek-v3.2")
    assert fp8.kv_bytes_per_token == preset.kv_bytes_per_token
    assert fp8.attn_linear_params_per_layer == preset.attn_linear_params_per_layer
    assert fp8.ffn_active_params_per_token == preset.ffn_active_params_per_token
    assert fp8.dsa_top_k == 2048


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("malformed.json", r"malformed.json:2: invalid JSON"),
        ("unsupported.json", r"'model_type'='mamba' is not supported"),
        ("missing-field.json", r"missing field 'num_hidden_layers'"),
        ("absent.json", r"cannot read"),
    ],
)
def test_bad_configs_fail_with_one_line(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        ModelSpec.from_hf_config(CONFIGS / name)
    assert "\n" not in str(err.value)
    assert isinstance(err.value, DualPathError)


def test_unknown_model_preset() -> None:
    with pytest.raises(UnknownPresetError, match="deepseek-v3.2"):
        model_preset("gpt-5")


def test_kv_heads_that_do_not_divide_the_heads_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from dualpath.cli.main import main

    path = tmp_path / "config.json"
    config = json.loads((CONFIGS / "llama-tiny-fp32.json").read_text())
    path.write_text(json.dumps({**config, "num_attention_heads": 32, "num_key_value_heads": 7}))
    with pytest.raises(ConfigError, match=r"'num_key_value_heads'=7 must divide "
                                          r"num_attention_heads=32"):
        ModelSpec.from_hf_config(path)
    assert main(["simulate", "--agents", "1", "--model-config", str(path)]) == 2
    assert "num_key_value_heads" in capsys.readouterr().err


def test_tensor_parallel_needs_heads_that_split_and_a_known_hidden_size() -> None:
    from dualpath.core.errors import SpecError

    m = model_preset("smollm2-135m")  # 9 attention heads
    m.check_tensor_parallel(3)
    with pytest.raises(SpecError, match="num_attention_heads=9: must be divisible by the "
                                        "tensor-parallel size 2"):
        m.check_tensor_parallel(2)
    with pytest.raises(SpecError, match="hidden_size=0"):
        m.with_overrides(hidden_size=0).check_tensor_parallel(3)


@pytest.mark.parametrize("kv", [0, 3, 8, True])
def test_impossible_kv_element_sizes_are_refused(kv: int, tmp_path: Path) -> None:
    from dualpath.core.errors import SpecError

    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "intermediate_size": 128}))
    with pytest.raises(SpecError, match="kv_dtype_bytes=.*must be 1 \\(FP8\\), 2"):
        model_from_hf_config(tmp_path, kv_dtype_bytes=kv)
