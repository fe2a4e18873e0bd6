"""Model specs: KV-cache bytes per token and FLOPs per token, with presets and HF configs.

FLOP conventions (used by the cost model and the intra-engine scheduler):
- a matmul of an `m x k` by `k x n` costs `2*m*k*n` FLOPs;
- "linear" FLOPs per token are `2 x` the parameters a token touches (attention projections,
  dense FFN or the active experts of an MoE layer), embeddings and LM head excluded;
- attention-score FLOPs of one query over `n` keys are `2 * n * heads * (d_qk + d_v)` per layer
  (QK^T and AV). With DeepSeek Sparse Attention (DSA) a query attends `min(n, top_k)` keys, and
  the lightning indexer scans all `n` keys at `2 * index_heads * index_head_dim` FLOPs each.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

from dualpath.core.errors import SpecError, UnknownPresetError
from dualpath.core.validate import non_negative, non_negative_int, positive, positive_int


class AttentionKind(str, Enum):
    """How a model's attention stores KV and spends compute."""

    MHA = "mha"
    GQA = "gqa"
    MLA = "mla"
    MLA_DSA = "mla-dsa"


@dataclass(frozen=True)
class ModelSpec:
    """A model as the cluster sees it. Frozen, validated on construction."""

    name: str
    num_layers: int
    attention: AttentionKind
    kv_bytes_per_token_per_layer: float
    """KV-cache bytes one token occupies in one layer (main KV plus DSA indexer keys)."""
    num_attention_heads: int
    attn_qk_head_dim: int
    """Per-head dot-product width of the prefill attention (192 for non-absorbed MLA)."""
    attn_v_head_dim: int
    attn_linear_params_per_layer: float
    """Parameters of one layer's attention projections (incl. the DSA indexer's)."""
    ffn_active_params_per_token: float
    """FFN parameters one token touches over all layers (dense FFN or active experts)."""
    weight_bytes: float
    """All weights as stored for inference."""
    dsa_top_k: int = 0
    """Keys a query attends to with DeepSeek Sparse Attention (0: dense attention)."""
    dsa_index_heads: int = 0
    dsa_index_head_dim: int = 0
    is_moe: bool = False
    """MoE models run attention data-parallel and FFN expert-parallel across a node."""
    source: str = ""
    hidden_size: int = 0
    """Width of the residual stream: what a tensor-parallel engine all-reduces per token and
    layer. 0: not known (the model cannot be planned tensor-parallel)."""
    num_kv_heads: int = 0
    """KV heads of a GQA or MHA model; 0 for MLA (one latent serves every head)."""

    def __post_init__(self) -> None:
        owner = f"model[{self.name}]"
        positive_int(owner, "num_layers", self.num_layers)
        if not isinstance(self.attention, AttentionKind):
            raise SpecError(owner, "attention", self.attention, "must be an AttentionKind")
        positive(owner, "kv_bytes_per_token_per_layer", self.kv_bytes_per_token_per_layer)
        positive_int(owner, "num_attention_heads", self.num_attention_heads)
        positive_int(owner, "attn_qk_head_dim", self.attn_qk_head_dim)
        positive_int(owner, "attn_v_head_dim", self.attn_v_head_dim)
        non_negative(owner, "attn_linear_params_per_layer", self.attn_linear_params_per_layer)
        non_negative(owner, "ffn_active_params_per_token", self.ffn_active_params_per_token)
        positive(owner, "weight_bytes", self.weight_bytes)
        non_negative_int(owner, "dsa_top_k", self.dsa_top_k)
        non_negative_int(owner, "dsa_index_heads", self.dsa_index_heads)
        non_negative_int(owner, "dsa_index_head_dim", self.dsa_index_head_dim)
        non_negative_int(owner, "hidden_size", self.hidden_size)
        non_negative_int(owner, "num_kv_heads", self.num_kv_heads)
        if (self.attention is AttentionKind.MLA_DSA) != (self.dsa_top_k > 0):
            raise SpecError(
                owner, "dsa_top_k", self.dsa_top_k, "must be > 0 exactly when attention is mla-dsa"
            )

    # -- KV size ---------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes of one token over all layers (one Full Block row)."""
        return self.kv_bytes_per_token_per_layer * self.num_layers

    def kv_bytes(self, num_tokens: float) -> float:
        """KV bytes of `num_tokens` tokens over all layers."""
        return self.kv_bytes_per_token * num_tokens

    # -- tensor parallelism ----------------------------------------------------------------
    def check_tensor_parallel(self, tensor_parallel_size: int) -> None:
        """Raise SpecError unless an engine of `tensor_parallel_size` GPUs can shard this
        model: its attention heads split evenly over the GPUs (vLLM refuses otherwise) and its
        hidden size, which sets the all-reduces, is known."""
        owner = f"model[{self.name}]"
        positive_int(owner, "tensor_parallel_size", tensor_parallel_size)
        if tensor_parallel_size == 1:
            return
        if self.num_attention_heads % tensor_parallel_size:
            raise SpecError(owner, "num_attention_heads", self.num_attention_heads,
                            f"must be divisible by the tensor-parallel size "
                            f"{tensor_parallel_size}")
        if not self.hidden_size:
            raise SpecError(owner, "hidden_size", self.hidden_size,
                            "must be known (> 0) for a tensor-parallel engine")

    def kv_replicas(self, tensor_parallel_size: int) -> int:
        """Copies of each token's KV an engine of `tensor_parallel_size` GPUs holds in HBM:
        heads are split over the GPUs, so a GQA model with fewer KV heads than GPUs keeps each
        on several (vLLM's rule), and MLA's latent, shared by every head, is on every GPU."""
        if tensor_parallel_size <= 1:
            return 1
        if self.attention in (AttentionKind.MLA, AttentionKind.MLA_DSA):
            return tensor_parallel_size
        return max(1, tensor_parallel_size // max(1, self.num_kv_heads))

    # -- FLOPs -----------------------------------------------------------------------------
    @property
    def attn_linear_flops_per_token(self) -> float:
        """Attention projection FLOPs of one token over all layers."""
        return 2.0 * self.attn_linear_params_per_layer * self.num_layers

    @property
    def ffn_flops_per_token(self) -> float:
        """FFN / MoE FLOPs of one token over all layers (active experts only)."""
        return 2.0 * self.ffn_active_params_per_token

    def indexer_flops_per_layer(self, context_tokens: float) -> float:
        """DSA lightning-indexer FLOPs of one query in one layer (0 for dense attention)."""
        return 2.0 * self.dsa_index_heads * self.dsa_index_head_dim * context_tokens

    def prefill_attention_flops(self, cached_tokens: float, new_tokens: float) -> float:
        """Attention FLOPs (scores + indexer, all layers) to prefill `new_tokens` after
        `cached_tokens` whose KV is already available; causal, so token i sees i+1 keys.

        Closed form: dense score work is linear in context, so the sum over the new tokens is
        `new * (cached + (new + 1) / 2)` keys; with DSA the part beyond top-k is capped.
        """
        if new_tokens <= 0:
            return 0.0
        per_key = 2.0 * self.num_attention_heads * (self.attn_qk_head_dim + self.attn_v_head_dim)
        first, last = cached_tokens + 1.0, cached_tokens + new_tokens
        keys = _sum_capped(first, last, float(self.dsa_top_k) if self.dsa_top_k else None)
        index_keys = (first + last) * new_tokens / 2.0 if self.dsa_top_k else 0.0
        per_index_key = 2.0 * self.dsa_index_heads * self.dsa_index_head_dim
        return self.num_layers * (per_key * keys + per_index_key * index_keys)

    def prefill_linear_flops(self, new_tokens: float) -> float:
        """Projection + FFN FLOPs (all layers) for `new_tokens` tokens."""
        return new_tokens * (self.attn_linear_flops_per_token + self.ffn_flops_per_token)

    def with_overrides(self, **fields: object) -> ModelSpec:
        """A copy with some fields replaced (validated again)."""
        return replace(self, **fields)  # type: ignore[arg-type]

    @staticmethod
    def from_hf_config(
        path: str | Path, kv_dtype_bytes: int | None = None, name: str | None = None
    ) -> ModelSpec:
        """See `dualpath.core.hf_config.model_from_hf_config`."""
        from dualpath.core.hf_config import model_from_hf_config  # it builds on this module

        return model_from_hf_config(path, kv_dtype_bytes, name)


def _sum_capped(first: float, last: float, cap: float | None) -> float:
    """Sum of min(x, cap) for x = first, first+1, ..., last (real-valued closed form)."""
    n = last - first + 1.0
    if cap is None or last <= cap:
        return (first + last) * n / 2.0
    if first >= cap:
        return cap * n
    below = cap - first + 1.0
    return (first + cap) * below / 2.0 + cap * (n - below)


# -- presets ---------------------------------------------------------------------------------


def mla_attn_params(
    hidden: int,
    heads: int,
    q_lora: int,
    kv_lora: int,
    qk_nope: int,
    qk_rope: int,
    v_dim: int,
    index_heads: int = 0,
    index_dim: int = 0,
) -> float:
    """Parameters of one MLA layer's attention projections (with the DSA indexer's)."""
    q = (
        hidden * q_lora + q_lora * heads * (qk_nope + qk_rope)
        if q_lora
        else hidden * heads * (qk_nope + qk_rope)
    )
    kv = hidden * (kv_lora + qk_rope) + kv_lora * heads * (qk_nope + v_dim)
    out = heads * v_dim * hidden
    indexer = 0
    if index_heads:
        q_in = q_lora if q_lora else hidden
        indexer = q_in * index_heads * index_dim + hidden * index_dim + hidden * index_heads
    return float(q + kv + out + indexer)


def _gqa_attn_params(hidden: int, heads: int, kv_heads: int, head_dim: int) -> float:
    return float(hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2)


def moe_ffn_params(
    hidden: int,
    num_layers: int,
    num_dense_layers: int,
    dense_intermediate: int,
    moe_intermediate: int,
    routed: int,
    active: int,
    shared: int,
) -> tuple[float, float]:
    """(active FFN params per token over all layers, total FFN params)."""
    dense = 3 * hidden * dense_intermediate
    expert = 3 * hidden * moe_intermediate
    moe_layers = num_layers - num_dense_layers
    active_params = num_dense_layers * dense + moe_layers * (
        (active + shared) * expert + hidden * routed
    )
    total_params = num_dense_layers * dense + moe_layers * (
        (routed + shared) * expert + hidden * routed
    )
    return float(active_params), float(total_params)


MLA_FP8_KV_BYTES = 656
"""FP8 MLA KV of one token in one layer: 512 FP8 latent + 16 B scales + 64 bf16 RoPE dims
(vLLM PR #48439 summary)."""


def indexer_key_bytes(index_dim: int) -> int:
    """FP8 indexer key plus one fp32 scale."""
    return index_dim + 4


def _deepseek_v32() -> ModelSpec:
    hidden, layers, heads = 7168, 61, 128
    attn = mla_attn_params(hidden, heads, 1536, 512, 128, 64, 128, 64, 128)
    ffn_active, ffn_total = moe_ffn_params(hidden, layers, 3, 18432, 2048, 256, 8, 1)
    total_params = attn * layers + ffn_total + 2 * 129280 * hidden
    return ModelSpec(
        name="deepseek-v3.2",
        num_layers=layers,
        attention=AttentionKind.MLA_DSA,
        kv_bytes_per_token_per_layer=MLA_FP8_KV_BYTES + indexer_key_bytes(128),
        num_attention_heads=heads,
        attn_qk_head_dim=192,
        attn_v_head_dim=128,
        attn_linear_params_per_layer=attn,
        ffn_active_params_per_token=ffn_active,
        weight_bytes=total_params,  # FP8 weights: one byte per parameter
        dsa_top_k=2048,
        dsa_index_heads=64,
        dsa_index_head_dim=128,
        is_moe=True,
        hidden_size=hidden,
        source=(
            "DeepSeek-V3.2 HF config: hidden 7168, 61 layers, 128 heads, MLA (q_lora 1536, "
            "kv_lora 512, nope 128, rope 64, v 128), 3 dense layers (18432) then 256 routed + 1 "
            "shared expert, top-8, moe 2048; DSA indexer 64x128, top-k 2048; FP8 KV 656 B + "
            "132 B indexer key per token per layer (~48 KB/token)"
        ),
    )


def _ds_27b() -> ModelSpec:
    hidden, layers, heads = 2560, 30, 32
    attn = mla_attn_params(hidden, heads, 1536, 512, 128, 64, 128, 32, 64)
    ffn_active, ffn_total = moe_ffn_params(hidden, layers, 1, 12288, 1536, 72, 6, 2)
    total_params = attn * layers + ffn_total + 2 * 129280 * hidden
    return ModelSpec(
        name="ds-27b",
        num_layers=layers,
        attention=AttentionKind.MLA_DSA,
        kv_bytes_per_token_per_layer=MLA_FP8_KV_BYTES + indexer_key_bytes(64),
        num_attention_heads=heads,
        attn_qk_head_dim=192,
        attn_v_head_dim=128,
        attn_linear_params_per_layer=attn,
        ffn_active_params_per_token=ffn_active,
        weight_bytes=total_params,
        dsa_top_k=1024,
        dsa_index_heads=32,
        dsa_index_head_dim=64,
        is_moe=True,
        hidden_size=hidden,
        source=(
            "paper A.2: hidden 2560, 30 layers, 32 heads, 72 routed experts (moe 1536, 6 "
            "active, 2 shared), 1 dense layer (12288), indexer 32x64, top-k 1024; MLA dims not "
            "given, assumed V3.2-like (inferred, ~21.7 KB/token)"
        ),
    )


def dense_gqa_spec(
    name: str,
    *,
    hidden: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate: int,
    vocab_size: int,
    kv_dtype_bytes: int,
    weight_dtype_bytes: int,
    is_tied_embeddings: bool = False,
    source: str = "",
) -> ModelSpec:
    """A dense Llama-family model (GQA, or MHA when kv heads == heads) with a SwiGLU FFN:
    KV = 2 x kv_heads x head_dim x dtype bytes per token per layer."""
    attn = _gqa_attn_params(hidden, num_heads, num_kv_heads, head_dim)
    ffn = float(num_layers * 3 * hidden * intermediate)
    embed = (1 if is_tied_embeddings else 2) * vocab_size * hidden
    return ModelSpec(
        name=name,
        num_layers=num_layers,
        attention=AttentionKind.MHA if num_kv_heads == num_heads else AttentionKind.GQA,
        kv_bytes_per_token_per_layer=2 * num_kv_heads * head_dim * kv_dtype_bytes,
        num_attention_heads=num_heads,
        attn_qk_head_dim=head_dim,
        attn_v_head_dim=head_dim,
        attn_linear_params_per_layer=attn,
        ffn_active_params_per_token=ffn,
        weight_bytes=float(weight_dtype_bytes * (attn * num_layers + ffn + embed)),
        source=source,
        hidden_size=hidden,
        num_kv_heads=num_kv_heads,
    )


def _qwen25_32b() -> ModelSpec:
    return dense_gqa_spec(
        "qwen2.5-32b",
        hidden=5120,
        num_layers=64,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        intermediate=27648,
        vocab_size=152064,
        kv_dtype_bytes=2,
        weight_dtype_bytes=1,
        source="Qwen2.5-32B HF config: 64 layers, 40 heads, 8 KV heads, head dim 128, "
        "intermediate 27648; FP16 KV (paper Table 1) = 256 KiB/token. Weights assumed FP8 "
        "(inferred): the paper runs it data-parallel only (one GPU per replica), and FP16 "
        "weights (65 GB) would leave an 80 GB GPU no room for one 64K-token FP16 KV (17 GB)",
    )


def _smollm2_135m() -> ModelSpec:
    return dense_gqa_spec(
        "smollm2-135m",
        hidden=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate=1536,
        vocab_size=49152,
        kv_dtype_bytes=2,
        weight_dtype_bytes=2,
        is_tied_embeddings=True,
        source="SmolLM2-135M-Instruct config: 30 layers, 9 heads, 3 KV heads, head dim 64, "
        "intermediate 1536, tied embeddings; bf16 KV = 23,040 B/token",
    )


MODEL_PRESETS: dict[str, ModelSpec] = {
    spec.name: spec for spec in (_deepseek_v32(), _ds_27b(), _qwen25_32b(), _smollm2_135m())
}


def model_preset(name: str) -> ModelSpec:
    """The named preset; UnknownPresetError lists the valid names."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise UnknownPresetError("model", name, list(MODEL_PRESETS)) from None
