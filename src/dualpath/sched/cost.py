"""GPU cost model: FLOPs- and bytes-based step times with fitted efficiency coefficients.

Plain functions of (ModelSpec, HardwareSpec, CostCoefficients); no simulator or runtime imports.
The simulator charges GPU time with them and the intra-engine scheduler packs batches with
them, so both worlds agree on what a forward pass costs.

Shape of the model (each term scaled by a fitted coefficient, the "trained roofline" recipe):

- prefill attention, per engine and forward pass, from the batch's `(cached, bsz)` pairs:
  `num_layers * per_layer_overhead_s + sum over pairs of
  [attention_flops(cached, bsz) / (attention_efficiency * bf16 peak)
   + bsz * attention-projection FLOPs / (linear_efficiency * linear peak)]`.
  `attention_flops` is `ModelSpec.prefill_attention_flops`: causal scores, and for DeepSeek-V3.2
  (MLA + DSA) scores over `min(context, top_k)` keys plus the lightning indexer over all keys.
  The estimate is additive over pairs, which is what lets packing run in O(batch * log bsz).
- prefill FFN (dense or MoE, active experts only) for `num_tokens` tokens on one engine, plus a
  per-MoE-layer overhead (expert-parallel dispatch/combine latency).
- decode step, memory bound: the engine's share of weights (MoE experts sharded over the node,
  dense weights replicated) plus the KV it reads, over `decode_hbm_efficiency * HBM bandwidth`;
  with DSA the indexer keys of all context tokens are read but main KV only for
  `min(context, top_k)` of them. The step never runs faster than its compute time.
- tensor parallelism: `hw` is the engine's view of the node (`HardwareSpec.engine_view`), so an
  engine of `t` GPUs has `t` times one GPU's FLOP/s, HBM and HBM bandwidth, and its KV heads
  split over them (`ModelSpec.kv_replicas` when they cannot). Each forward pass adds two
  all-reduces per layer (after attention and after the FFN) of the tokens' hidden states, each
  `allreduce_latency_s + bytes * 2(t-1)/t / (allreduce_efficiency * NVLink)` (a ring), charged
  with the FFN phase of a prefill pass and on top of a decode step. Kernels' efficiency is the
  same at every `t` (shards of smaller GEMMs run less efficiently: docs/measurements.md has the
  comparison with Vidur's profiles).

Coefficients live in `dualpath/data/cost_coefficients.json`, one entry per (model, hardware)
with `*` wildcards and a `source` note; override any of them with `dataclasses.replace`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any, Final, Protocol, final

from dualpath.core.datafile import read_entries
from dualpath.core.errors import DualPathError, SpecError
from dualpath.core.hardware import HardwareSpec
from dualpath.core.model import ModelSpec
from dualpath.core.pickling import pickle_by_fields
from dualpath.core.validate import non_negative, non_negative_int, positive

WILDCARD = "*"


class CostFileError(DualPathError, ValueError):
    """A cost-coefficient file that cannot be read or holds an invalid entry."""


DEFAULT_HBM_RESERVE_FRACTION = 0.1
"""`CostCoefficients.hbm_reserve_fraction` unless a cost entry sets it."""

ACTIVATION_BYTES = 2
"""Bytes per element of the hidden states a tensor-parallel engine all-reduces (BF16)."""


@dataclass(frozen=True)
class CostCoefficients:
    """Fitted efficiencies and overheads of one (model, hardware) pair. Frozen, validated.

    Efficiencies are fractions of the datasheet peak the kernels reach; overheads are seconds.
    """

    attention_efficiency: float
    """Fraction of the BF16 peak reached by prefill attention (scores + DSA indexer)."""
    linear_efficiency: float
    """Fraction of the linear peak (FP8 or BF16, see `is_fp8_linear`) reached by GEMMs."""
    decode_hbm_efficiency: float
    """Fraction of HBM bandwidth a decode step reaches reading weights and KV."""
    per_layer_overhead_s: float
    """Fixed time per layer per forward pass (launches, norms, sync), attention side."""
    per_step_overhead_s: float
    """Fixed time per forward pass (scheduling, sampling, CPU-side work)."""
    moe_layer_overhead_s: float
    """Fixed time per MoE layer per forward pass (expert-parallel dispatch + combine)."""
    is_fp8_linear: bool = True
    """Linear layers run on FP8 tensor cores (DeepSeek) rather than BF16."""
    hbm_reserve_fraction: float = DEFAULT_HBM_RESERVE_FRACTION
    """Fraction of each GPU's HBM that holds neither weights nor KV: activations, CUDA graphs,
    communication buffers, fragmentation. It sets how many sequences a decode engine holds, the
    decode batch. With no sequence cap it is what bounds Oracle's throughput at high load."""
    max_seqs_per_decode_engine: int = 0
    """Most sequences one decode engine holds at once, like serving systems' "max running
    requests" (vLLM `max_num_seqs`, SGLang `max_running_requests`); 0: no cap, HBM alone limits.
    Feeds `SchedulerParams.max_seqs_per_decode_engine`; fitted with the GPU times to the paper's
    Oracle at high load (not a value the paper states)."""
    source: str = ""
    """Where the values come from, or what they were fitted to."""
    allreduce_latency_s: float = 30e-6
    """Fixed time of one all-reduce across a tensor-parallel engine's GPUs. Default: set from
    Vidur's published NCCL all-reduce profile of an 8-GPU H100 DGX node (docs/measurements.md)."""
    allreduce_efficiency: float = 0.85
    """Fraction of the NVLink bandwidth (`HardwareSpec.nvlink_bytes_per_s`) a ring all-reduce's
    transfers reach; default from the same profile."""

    def __post_init__(self) -> None:
        owner = "cost_coefficients"
        for name in ("attention_efficiency", "linear_efficiency", "decode_hbm_efficiency",
                     "allreduce_efficiency"):
            value = getattr(self, name)
            positive(owner, name, value)
            if value > 1.0:
                raise SpecError(owner, name, value, "is a fraction of peak and must be <= 1")
        for name in ("per_layer_overhead_s", "per_step_overhead_s", "moe_layer_overhead_s",
                     "allreduce_latency_s"):
            non_negative(owner, name, getattr(self, name))
        non_negative(owner, "hbm_reserve_fraction", self.hbm_reserve_fraction)
        if self.hbm_reserve_fraction >= 1.0:
            raise SpecError(owner, "hbm_reserve_fraction", self.hbm_reserve_fraction,
                            "must be < 1")
        non_negative_int(owner, "max_seqs_per_decode_engine", self.max_seqs_per_decode_engine)
        if not isinstance(self.is_fp8_linear, bool):
            raise SpecError(owner, "is_fp8_linear", self.is_fp8_linear, "must be true or false")


_FIELDS = {f.name for f in fields(CostCoefficients)}


def default_cost_file() -> Path:
    """The packaged `dualpath/data/cost_coefficients.json`."""
    return Path(str(resources.files("dualpath").joinpath("data/cost_coefficients.json")))


def _read_entries(path: Path) -> list[dict[str, Any]]:
    return read_entries(path, CostFileError)


def _line_of(text: str, index: int) -> int:
    """1-based line where the `index`-th entry object starts (for error messages)."""
    seen = -1
    for lineno, line in enumerate(text.splitlines(), start=1):
        if '"model"' in line:
            seen += 1
            if seen == index:
                return lineno
    return 0


def load_cost_coefficients(
    model: str, hardware: str, path: str | Path | None = None
) -> CostCoefficients:
    """Coefficients for (model, hardware) from `path` (default: the packaged file).

    Lookup order: exact (model, hardware), then (model, `*`), then (`*`, hardware), then
    (`*`, `*`). Errors name the file, line and field.
    """
    p = Path(path) if path is not None else default_cost_file()
    entries = _read_entries(p)
    text = p.read_text(encoding="utf-8")
    by_key: dict[tuple[str, str], tuple[int, dict[str, Any]]] = {}
    for i, entry in enumerate(entries):
        key = (str(entry.get("model", "")), str(entry.get("hardware", "")))
        if not key[0] or not key[1]:
            raise CostFileError(f"{p}:{_line_of(text, i)}: entry {i} needs 'model' and 'hardware'")
        by_key[key] = (i, entry)
    for key in ((model, hardware), (model, WILDCARD), (WILDCARD, hardware), (WILDCARD, WILDCARD)):
        if key in by_key:
            i, entry = by_key[key]
            values = {k: v for k, v in entry.items() if k not in ("model", "hardware")}
            unknown = sorted(set(values) - _FIELDS)
            where = f"{p}:{_line_of(text, i)}"
            if unknown:
                raise CostFileError(
                    f"{where}: entry {i} has unknown field(s) {', '.join(unknown)}; "
                    f"valid: {', '.join(sorted(_FIELDS))}"
                )
            if not values.get("source"):
                raise CostFileError(f"{where}: entry {i} needs a 'source' note")
            try:
                # Checked before construction: the compiled class's own type error for a
                # non-integer would not name the field.
                non_negative_int("cost_coefficients", "max_seqs_per_decode_engine",
                                 values.get("max_seqs_per_decode_engine", 0))
                return CostCoefficients(**values)
            except SpecError as exc:
                raise CostFileError(f"{where}: entry {i}: {exc}") from None
            except TypeError as exc:
                raise CostFileError(f"{where}: entry {i}: {exc}") from None
    raise CostFileError(
        f"{p}: no entry for model {model!r} on hardware {hardware!r} and no '*' entry"
    )


def coefficients_for(model: ModelSpec, hw: HardwareSpec) -> CostCoefficients:
    """Packaged coefficients for this model and hardware (by preset name)."""
    return load_cost_coefficients(model.name, hw.name)


# -- per-phase times -------------------------------------------------------------------------

def _linear_flops_per_s(hw: HardwareSpec, coeffs: CostCoefficients) -> float:
    peak = hw.gpu_fp8_flops_per_s if coeffs.is_fp8_linear else hw.gpu_bf16_flops_per_s
    return peak * coeffs.linear_efficiency


def attention_fixed_time_s(model: ModelSpec, coeffs: CostCoefficients) -> float:
    """Request-independent attention time of one forward pass (all layers)."""
    return model.num_layers * coeffs.per_layer_overhead_s


def attention_pair_time_s(
    model: ModelSpec, hw: HardwareSpec, cached_tokens: float, new_tokens: float,
    coeffs: CostCoefficients,
) -> float:
    """Attention time (all layers) one request adds to a forward pass: scores + indexer for
    `new_tokens` after `cached_tokens`, plus the attention projections of the new tokens.
    Non-decreasing in both arguments; 0 when `new_tokens` is 0."""
    if new_tokens <= 0:
        return 0.0
    c = _constants(model, hw, coeffs)
    # `ModelSpec.prefill_attention_flops`, term by term in its order, on hoisted constants.
    first, last = cached_tokens + 1.0, cached_tokens + new_tokens
    n = last - first + 1.0
    if c.top_k <= 0.0 or last <= c.top_k:
        keys = (first + last) * n / 2.0
    elif first >= c.top_k:
        keys = c.top_k * n
    else:
        below = c.top_k - first + 1.0
        keys = (first + c.top_k) * below / 2.0 + c.top_k * (n - below)
    index_keys = (first + last) * new_tokens / 2.0 if c.top_k > 0.0 else 0.0
    flops = c.num_layers * (c.per_key * keys + c.per_index_key * index_keys)
    return flops / c.attn_flops_per_s + new_tokens * c.attn_linear_flops / c.linear_flops_per_s


def prefill_attention_time_s(
    model: ModelSpec, hw: HardwareSpec, pairs: Iterable[tuple[float, float]],
    coeffs: CostCoefficients,
) -> float:
    """Attention-layer time of one forward pass on one engine for `(cached, bsz)` pairs."""
    return attention_fixed_time_s(model, coeffs) + sum(
        attention_pair_time_s(model, hw, c, b, coeffs) for c, b in pairs
    )


def _num_moe_layers(model: ModelSpec) -> int:
    # ModelSpec does not record the dense-prefix layer count; the few dense layers of the
    # DeepSeek models (3 of 61, 1 of 30) are charged the MoE overhead too (within fit error).
    return model.num_layers if model.is_moe else 0


def prefill_ffn_time_s(
    model: ModelSpec, hw: HardwareSpec, num_tokens: float, coeffs: CostCoefficients
) -> float:
    """FFN / MoE time of one forward pass on one engine processing `num_tokens` new tokens
    (active experts only; expert-parallel latency as a per-MoE-layer overhead), with the pass's
    tensor-parallel all-reduces (`allreduce_time_s`)."""
    c = _constants(model, hw, coeffs)
    ffn_s = num_tokens * c.ffn_flops / c.linear_flops_per_s + c.moe_overhead_s
    if c.tp > 1 and num_tokens > 0:
        return ffn_s + c.allreduce_fixed_s + num_tokens * c.allreduce_s_per_token
    return ffn_s


def allreduce_time_s(
    model: ModelSpec, hw: HardwareSpec, num_tokens: float, coeffs: CostCoefficients
) -> float:
    """The all-reduces of one forward pass over `num_tokens` tokens on a tensor-parallel
    engine (`hw.gpus_per_engine` GPUs; 0 on one GPU): two per layer, see the module docstring.
    Included in `prefill_ffn_time_s` and `decode_step_time_s`."""
    c = _constants(model, hw, coeffs)
    if c.tp <= 1 or num_tokens <= 0:
        return 0.0
    return c.allreduce_fixed_s + num_tokens * c.allreduce_s_per_token


def prefill_step_time_s(
    model: ModelSpec, hw: HardwareSpec, pairs: Sequence[tuple[float, float]],
    coeffs: CostCoefficients,
) -> float:
    """One whole prefill forward pass on one engine: attention + FFN + per-step overhead."""
    num_new = sum(b for _, b in pairs)
    return (
        prefill_attention_time_s(model, hw, pairs, coeffs)
        + prefill_ffn_time_s(model, hw, num_new, coeffs)
        + coeffs.per_step_overhead_s
    )


def kv_room_bytes(
    model: ModelSpec, hw: HardwareSpec, reserve_fraction: float, num_weight_shards: int
) -> float:
    """HBM one engine has left for KV: its capacity less the reserve and its weights (MoE
    weights sharded over `num_weight_shards` engines, dense weights replicated), in bytes of
    KV as `ModelSpec.kv_bytes` counts them (a tensor-parallel engine that holds several copies
    of each token's KV, `ModelSpec.kv_replicas`, has that much less)."""
    w = model.weight_bytes / num_weight_shards if model.is_moe else model.weight_bytes
    room = max(0.0, hw.hbm_bytes * (1.0 - reserve_fraction) - w)
    replicas = model.kv_replicas(hw.gpus_per_engine)
    return room / replicas if replicas > 1 else room


def _indexer_key_bytes_per_layer(model: ModelSpec) -> float:
    # Same layout as core.model: FP8 indexer key plus one fp32 scale per token per layer.
    return float(model.dsa_index_head_dim + 4) if model.dsa_top_k else 0.0


def decode_kv_read_bytes(model: ModelSpec, batch_size: int, total_context_tokens: float,
                         tensor_parallel_size: int = 1) -> float:
    """KV bytes one decode step reads for `batch_size` sequences of `total_context_tokens`,
    on an engine of `tensor_parallel_size` GPUs (each reads its copy, `ModelSpec.kv_replicas`).

    With DSA the indexer keys of every context token are read, but main KV only for
    `min(context, top_k)` tokens per sequence; per-sequence contexts are not known here, so the
    main part is `min(total, batch * top_k)` (exact when all contexts are >= top_k, or all <=).
    """
    replicas = model.kv_replicas(tensor_parallel_size)
    if not model.dsa_top_k:
        return replicas * model.kv_bytes_per_token * total_context_tokens
    index_bytes = _indexer_key_bytes_per_layer(model)
    main_bytes = model.kv_bytes_per_token_per_layer - index_bytes
    main_tokens = min(total_context_tokens, batch_size * model.dsa_top_k)
    return replicas * model.num_layers * (index_bytes * total_context_tokens
                                          + main_bytes * main_tokens)


def decode_weight_read_bytes(
    model: ModelSpec, hw: HardwareSpec, num_expert_parallel_engines: int | None = None
) -> float:
    """Weight bytes one engine reads per decode step. MoE weights are expert-sharded over the
    `num_expert_parallel_engines` engines that hold them (default: one node's GPUs; the
    simulator passes every decode engine, as it places the weights); attention weights being
    replicated is within fit error. Dense models replicate all weights on every engine."""
    if not model.is_moe:
        return model.weight_bytes
    return model.weight_bytes / (num_expert_parallel_engines or hw.gpus_per_node)


def decode_step_time_s(
    model: ModelSpec, hw: HardwareSpec, batch_size: int, total_context_tokens: float,
    coeffs: CostCoefficients, num_expert_parallel_engines: int | None = None,
) -> float:
    """One decode step on one engine (one token for each of `batch_size` sequences holding
    `total_context_tokens` tokens in all): max(memory time, compute time) + overheads, and a
    tensor-parallel engine's all-reduces (`allreduce_time_s`).
    `num_expert_parallel_engines`: see `decode_weight_read_bytes`."""
    if batch_size <= 0:
        return 0.0
    c = _constants(model, hw, coeffs)
    ctx = total_context_tokens
    # The terms of `decode_weight_read_bytes` + `decode_kv_read_bytes` and of the compute
    # time, in their order, on hoisted constants (so every float is the same).
    weight = (c.weight_bytes / (num_expert_parallel_engines or c.gpus_per_node) if c.is_moe
              else c.weight_bytes)
    if c.top_k > 0.0:
        sparse_keys = float(batch_size) * c.top_k
        attn_keys = sparse_keys if sparse_keys < ctx else ctx
        kv = c.num_layers * (c.index_key_bytes * ctx + c.main_key_bytes * attn_keys)
    else:
        attn_keys = ctx
        kv = c.kv_bytes_per_token * ctx
    if c.kv_replicas > 1:
        kv *= c.kv_replicas
    memory_s = (weight + kv) / c.hbm_bytes_per_s
    attn_flops = c.num_layers * (c.per_key * attn_keys + c.per_index_key * ctx)
    compute_s = (attn_flops / c.attn_flops_per_s
                 + batch_size * c.token_linear_flops / c.linear_flops_per_s)
    if c.tp > 1:
        return (max(memory_s, compute_s) + c.decode_overhead_s + c.allreduce_fixed_s
                + batch_size * c.allreduce_s_per_token)
    return max(memory_s, compute_s) + c.decode_overhead_s


@final
class _Constants:
    """The per-(model, hardware, coefficients) factors of the step times above, each computed
    by the same expression as where `ModelSpec` / the functions above compute it (so the step
    times are the same floats): the simulator charges hundreds of thousands of steps, and
    reading them off the frozen specs (properties included) each time dominated the cost."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, coeffs: CostCoefficients) -> None:
        self.model = model
        self.hw = hw
        self.coeffs = coeffs
        self.num_layers = float(model.num_layers)
        self.top_k = float(model.dsa_top_k)
        self.per_key = 2.0 * model.num_attention_heads * (
            model.attn_qk_head_dim + model.attn_v_head_dim)
        self.per_index_key = 2.0 * model.dsa_index_heads * model.dsa_index_head_dim
        self.attn_flops_per_s = hw.gpu_bf16_flops_per_s * coeffs.attention_efficiency
        self.attn_linear_flops = model.attn_linear_flops_per_token
        self.ffn_flops = model.ffn_flops_per_token
        self.token_linear_flops = model.attn_linear_flops_per_token + model.ffn_flops_per_token
        self.moe_overhead_s = _num_moe_layers(model) * coeffs.moe_layer_overhead_s
        self.linear_flops_per_s = _linear_flops_per_s(hw, coeffs)
        self.is_moe = model.is_moe
        self.weight_bytes = float(model.weight_bytes)
        self.gpus_per_node = hw.gpus_per_node
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self.index_key_bytes = _indexer_key_bytes_per_layer(model)
        self.main_key_bytes = model.kv_bytes_per_token_per_layer - self.index_key_bytes
        self.hbm_bytes_per_s = hw.hbm_bytes_per_s * coeffs.decode_hbm_efficiency
        self.decode_overhead_s = (
            model.num_layers * coeffs.per_layer_overhead_s
            + _num_moe_layers(model) * coeffs.moe_layer_overhead_s
            + coeffs.per_step_overhead_s
        )
        tp = hw.gpus_per_engine
        self.tp = tp
        self.kv_replicas = model.kv_replicas(tp)
        num_allreduces = 2.0 * model.num_layers
        self.allreduce_fixed_s = num_allreduces * coeffs.allreduce_latency_s if tp > 1 else 0.0
        ring_bytes = (2.0 * (tp - 1) / tp * model.hidden_size * ACTIVATION_BYTES)
        self.allreduce_s_per_token = (
            num_allreduces * ring_bytes / (coeffs.allreduce_efficiency * hw.nvlink_bytes_per_s)
            if tp > 1 else 0.0)


class _LastConstants:
    """The constants of the last (model, hardware, coefficients) asked for, by identity (one
    run charges one triple; the specs are frozen, and held here so an id is never reused)."""

    def __init__(self) -> None:
        self.last: _Constants | None = None


_LAST: Final = _LastConstants()


def _constants(model: ModelSpec, hw: HardwareSpec, coeffs: CostCoefficients) -> _Constants:
    c = _LAST.last
    if c is None or c.model is not model or c.hw is not hw or c.coeffs is not coeffs:
        c = _Constants(model, hw, coeffs)
        _LAST.last = c
    return c


# -- the estimator interface intra-engine packing takes --------------------------------------

class AttentionTimeEstimator(Protocol):
    """Additive estimate of a forward pass's attention-layer time on one engine:
    `fixed_time_s() + sum(pair_time_s(cached, bsz) for each pair)`.

    Contract: `pair_time_s` is >= 0, 0 for `bsz == 0`, and non-decreasing in `bsz` (packing
    binary-searches on it).
    """

    def fixed_time_s(self) -> float: ...

    def pair_time_s(self, cached_tokens: int, new_tokens: int) -> float: ...


@dataclass(frozen=True)
class CostModelEstimator:
    """The cost model as an `AttentionTimeEstimator` (what the simulator charges)."""

    model: ModelSpec
    hardware: HardwareSpec
    coeffs: CostCoefficients

    def fixed_time_s(self) -> float:
        return attention_fixed_time_s(self.model, self.coeffs)

    def pair_time_s(self, cached_tokens: int, new_tokens: int) -> float:
        return attention_pair_time_s(self.model, self.hardware, cached_tokens, new_tokens,
                                     self.coeffs)


def batch_attention_time_s(
    estimator: AttentionTimeEstimator, pairs: Iterable[tuple[int, int]]
) -> float:
    """Estimated attention time of a whole batch of `(cached, bsz)` pairs."""
    return estimator.fixed_time_s() + sum(estimator.pair_time_s(c, b) for c, b in pairs)


def prefill_tokens_per_s(
    model: ModelSpec, hw: HardwareSpec, cached_tokens: float, new_tokens: float,
    coeffs: CostCoefficients, compute_quota_s: float = 0.3,
) -> float:
    """Prompt tokens (cached + new) one engine completes per second when it prefills requests
    of this one shape back to back, packing as many per forward pass as the attention compute
    quota admits (at least one), so fixed overheads are amortised as in steady state."""
    positive("cost", "compute_quota_s", compute_quota_s)
    pair_s = attention_pair_time_s(model, hw, cached_tokens, new_tokens, coeffs)
    room_s = compute_quota_s - attention_fixed_time_s(model, coeffs)
    per_pass = max(1, int(room_s // pair_s)) if pair_s > 0 and room_s > 0 else 1
    t = prefill_step_time_s(model, hw, [(cached_tokens, new_tokens)] * per_pass, coeffs)
    if t <= 0 or not math.isfinite(t):
        raise SpecError("cost", "prefill_step_time_s", t, "must be a finite number > 0")
    return per_pass * (cached_tokens + new_tokens) / t


# Compiled (mypyc) frozen dataclasses unpickle only by constructor (runtime messages).
pickle_by_fields(CostCoefficients, CostModelEstimator)
