"""A HuggingFace `config.json` as a `ModelSpec`: the model types the planner supports, the KV
dtype, and errors that name the file and the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dualpath.core.errors import DualPathError, SpecError
from dualpath.core.model import (
    MLA_FP8_KV_BYTES,
    AttentionKind,
    ModelSpec,
    dense_gqa_spec,
    indexer_key_bytes,
    mla_attn_params,
    moe_ffn_params,
)

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "fp8": 1}
KV_DTYPE_BYTES = (1, 2, 4)
"""Bytes per KV-cache element a serving engine stores: FP8, FP16/BF16, FP32."""


class ConfigError(DualPathError, ValueError):
    """A config.json that is malformed or describes an unsupported model."""


def _get(cfg: dict[str, Any], path: str, key: str, kind: type = int, default: Any = None) -> Any:
    value = cfg.get(key, default)
    if value is None:
        raise ConfigError(f"{path}: missing field {key!r}")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(f"{path}: field {key!r}={value!r} must be a non-negative integer")
    return value


def model_from_hf_config(
    path: str | Path, kv_dtype_bytes: int | None = None, name: str | None = None
) -> ModelSpec:
    """Build a ModelSpec from a HuggingFace `config.json` (or the folder holding it).

    Supported `model_type`s: llama, mistral, qwen2, qwen3 (GQA/MHA: KV = 2 x kv_heads x head_dim
    x layers x dtype bytes) and deepseek_v3 / deepseek_v32 (MLA: (kv_lora_rank + rope dims) x
    dtype bytes, or the 656 B FP8 format when `kv_dtype_bytes=1`; V3.2 adds DSA indexer keys).
    The KV dtype defaults to the config's `torch_dtype`.
    """
    if kv_dtype_bytes is not None and (isinstance(kv_dtype_bytes, bool)
                                       or kv_dtype_bytes not in KV_DTYPE_BYTES):
        raise SpecError("model", "kv_dtype_bytes", kv_dtype_bytes,
                        "must be 1 (FP8), 2 (FP16/BF16) or 4 (FP32)")
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read ({exc.strerror})") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{p}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    except RecursionError:
        raise ConfigError(f"{p}: too deeply nested") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p}: top level must be a JSON object")
    where = str(p)
    model_type = cfg.get("model_type")
    if model_type is None:
        raise ConfigError(f"{where}: missing field 'model_type'")
    dtype = cfg.get("torch_dtype", cfg.get("dtype", "bfloat16"))
    if kv_dtype_bytes is None:
        if not isinstance(dtype, str) or dtype not in _DTYPE_BYTES:
            raise ConfigError(f"{where}: field 'torch_dtype'={dtype!r} is not supported")
        kv_dtype_bytes = _DTYPE_BYTES[dtype]
    hidden = _get(cfg, where, "hidden_size")
    layers = _get(cfg, where, "num_hidden_layers")
    heads = _get(cfg, where, "num_attention_heads")
    vocab = _get(cfg, where, "vocab_size", default=0)
    label = name or str(cfg.get("_name_or_path") or model_type)
    if model_type in ("llama", "mistral", "qwen2", "qwen3"):
        kv_heads = _get(cfg, where, "num_key_value_heads", default=heads)
        if not kv_heads or heads % kv_heads:  # the runtime refuses it too (ModelConfig)
            raise ConfigError(f"{where}: field 'num_key_value_heads'={kv_heads!r} must divide "
                              f"num_attention_heads={heads}")
        return dense_gqa_spec(
            label,
            hidden=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=_get(cfg, where, "head_dim", default=hidden // max(heads, 1)),
            intermediate=_get(cfg, where, "intermediate_size"),
            vocab_size=vocab,
            kv_dtype_bytes=kv_dtype_bytes,
            weight_dtype_bytes=_DTYPE_BYTES.get(dtype, 2) if isinstance(dtype, str) else 2,
            is_tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            source=f"from {where} ({model_type})",
        )
    if model_type in ("deepseek_v3", "deepseek_v32"):
        kv_lora = _get(cfg, where, "kv_lora_rank")
        rope = _get(cfg, where, "qk_rope_head_dim")
        nope = _get(cfg, where, "qk_nope_head_dim")
        v_dim = _get(cfg, where, "v_head_dim")
        q_lora = cfg.get("q_lora_rank") or 0
        index_topk = cfg.get("index_topk") or 0
        index_heads = (cfg.get("index_n_heads") or 0) if index_topk else 0
        index_dim = (cfg.get("index_head_dim") or 0) if index_topk else 0
        if kv_dtype_bytes == 1:
            kv = float(MLA_FP8_KV_BYTES) if (kv_lora, rope) == (512, 64) else kv_lora + 2.0 * rope
        else:
            kv = float((kv_lora + rope) * kv_dtype_bytes)
        if index_topk:
            kv += indexer_key_bytes(index_dim)
        attn = mla_attn_params(
            hidden, heads, q_lora, kv_lora, nope, rope, v_dim, index_heads, index_dim
        )
        ffn_active, ffn_total = moe_ffn_params(
            hidden,
            layers,
            _get(cfg, where, "first_k_dense_replace", default=0),
            _get(cfg, where, "intermediate_size"),
            _get(cfg, where, "moe_intermediate_size"),
            _get(cfg, where, "n_routed_experts"),
            _get(cfg, where, "num_experts_per_tok"),
            _get(cfg, where, "n_shared_experts", default=0),
        )
        return ModelSpec(
            name=label,
            num_layers=layers,
            attention=AttentionKind.MLA_DSA if index_topk else AttentionKind.MLA,
            kv_bytes_per_token_per_layer=kv,
            num_attention_heads=heads,
            attn_qk_head_dim=nope + rope,
            attn_v_head_dim=v_dim,
            attn_linear_params_per_layer=attn,
            ffn_active_params_per_token=ffn_active,
            weight_bytes=attn * layers + ffn_total + 2 * vocab * hidden,
            dsa_top_k=index_topk,
            dsa_index_heads=index_heads,
            dsa_index_head_dim=index_dim,
            is_moe=True,
            source=f"from {where} ({model_type})",
            hidden_size=hidden,
        )
    raise ConfigError(
        f"{where}: field 'model_type'={model_type!r} is not supported "
        "(supported: llama, mistral, qwen2, qwen3, deepseek_v3, deepseek_v32)"
    )
