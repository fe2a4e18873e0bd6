"""The shape of a Llama-family decoder (`ModelConfig`: what a checkpoint's `config.json`
says, its KV layout and its cost-model spec) and where models and KV caches live by default."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dualpath.core.errors import SpecError
from dualpath.core.model import ModelSpec, dense_gqa_spec
from dualpath.core.validate import non_negative_int, positive, positive_int
from dualpath.runtime.kvlayout import KVLayout


def default_device() -> torch.device:
    """CUDA when present, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder. Frozen, validated on construction."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_tokens: int = 8192
    is_tied_embeddings: bool = True
    has_qkv_bias: bool = False
    """Qwen2 has biases on the q, k and v projections; Llama does not."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        owner = f"model_config[{self.name}]"
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_attention_heads", "num_kv_heads", "head_dim", "max_position_tokens"):
            positive_int(owner, name, getattr(self, name))
        positive(owner, "rms_norm_eps", self.rms_norm_eps)
        positive(owner, "rope_theta", self.rope_theta)
        if self.num_attention_heads % self.num_kv_heads:
            raise SpecError(owner, "num_kv_heads", self.num_kv_heads,
                            f"must divide num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            raise SpecError(owner, "head_dim", self.head_dim, "must be even (RoPE pairs)")
        for token in self.eos_token_ids:
            non_negative_int(owner, "eos_token_ids", token)

    def kv_layout(self, block_size: int = 64, dtype: str = "float32") -> KVLayout:
        """The Full Block layout of this model's KV at `block_size` tokens per block."""
        return KVLayout(self.num_layers, block_size, self.num_kv_heads, self.head_dim, dtype)

    def to_model_spec(self, kv_dtype: str = "float32") -> ModelSpec:
        """This model as the cluster sees it (KV size and FLOPs for the cost model)."""
        dtype_bytes = self.kv_layout(1, kv_dtype).dtype_bytes
        return dense_gqa_spec(
            self.name,
            hidden=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_attention_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate=self.intermediate_size,
            vocab_size=self.vocab_size,
            kv_dtype_bytes=dtype_bytes,
            weight_dtype_bytes=dtype_bytes,
            is_tied_embeddings=self.is_tied_embeddings,
            source=f"runtime model config {self.name}",
        )
