"""A Llama-family model (Llama, SmolLM2, Qwen2) whose forward pass runs layer by layer.

Prefill (what a PE runs, paper §2.1 layerwise prefill): `begin_prefill` embeds the new tokens,
`prefill_layer` runs one decoder layer given the KV of the cached tokens of that layer and
returns the KV of the new tokens of that layer (to be shipped onward to the DE buffer), and
`finish_prefill` returns the logits of the last position. Only one layer's cached KV has to be
in engine memory at a time.

Decode (what a DE runs): sequences keep their KV in a paged `KVCache` in engine memory;
`decode_step` runs one token of each sequence of a batch and samples the next.

All math is plain PyTorch in the model dtype (fp32 by default, so KV loaded from storage is bit
for bit the KV a recompute would produce). The RoPE table is precomputed once and indexed, so a
position's rotation is the same bits in prefill and decode whatever the batch shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dualpath.core.errors import DualPathError, SpecError
from dualpath.core.model import ModelSpec, dense_gqa_spec
from dualpath.core.validate import non_negative_int, positive, positive_int
from dualpath.runtime.kvlayout import KV_DTYPES, KVLayout
from dualpath.runtime.sampling import SamplingParams, TokenLogprobs, sample

__all__ = ["SamplingParams"]  # re-exported: where the model's callers have always found it

ROPE_DTYPE = torch.float32


class KVCacheFullError(DualPathError):
    """The paged KV cache has too few free pages for a request."""


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


# -- weights ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer, HF Llama naming without the `model.layers.{i}.` prefix."""

    input_norm: torch.Tensor
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `config` must hold, by HF name, with its shape."""
    h, i = config.hidden_size, config.intermediate_size
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.is_tied_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if config.has_qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
            }
    return shapes


class WeightsError(DualPathError):
    """A checkpoint misses a tensor or holds one of the wrong shape."""


# -- prefill state ---------------------------------------------------------------------------

@dataclass
class PrefillState:
    """One sequence's prefill in progress: hidden states of its new tokens between layers."""

    token_ids: tuple[int, ...]
    """The prompt up to the end of this chunk; tokens `[num_cached_tokens:]` are new."""
    num_cached_tokens: int
    hidden: torch.Tensor
    """`[num_new_tokens, hidden_size]` after `next_layer` layers."""
    next_layer: int = 0

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids) - self.num_cached_tokens


# -- paged KV cache --------------------------------------------------------------------------

@dataclass
class DecodeSequence:
    """A sequence in decode. Its KV for every token but the last sits in a `KVCache`; the last
    token is pending (its KV is computed by the next `decode_step`)."""

    seq_id: int
    token_ids: list[int]
    """Prompt then generated tokens (the first generated one comes from prefill logits)."""
    num_prompt_tokens: int
    params: SamplingParams
    pages: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    """None while running; "length" or "eos" (an EOS or stop token) once finished."""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """One per generated token when `params.num_logprobs` is set."""

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose KV must be in the cache before the next decode step."""
        return len(self.token_ids) - 1

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, eos_token_ids: Sequence[int],
               logprobs: TokenLogprobs | None = None) -> None:
        """Record a generated token (and its logprobs) and decide whether the sequence is
        finished."""
        if self.is_finished:
            raise ValueError(f"sequence {self.seq_id} is already finished")
        self.token_ids.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if self.num_generated >= self.params.max_tokens:
            self.finish_reason = "length"
        elif self.params.stops_at(token, eos_token_ids):
            self.finish_reason = "eos"

    def sample(self, logits: torch.Tensor, eos_token_ids: Sequence[int]) -> int:
        """Sample the next token from `logits` and append it."""
        out = sample(logits, self.params, self.token_ids, self.num_prompt_tokens, eos_token_ids)
        self.append(out.token_id, eos_token_ids, out.logprobs)
        return out.token_id


class KVCache:
    """Paged KV of many sequences in engine memory (HBM on a GPU).

    Pages hold `page_tokens` tokens of every layer: `k`, `v` are
    `[num_layers, num_pages, page_tokens, num_kv_heads, head_dim]`. Token `t` of a sequence
    lives in page `seq.pages[t // page_tokens]`, row `t % page_tokens`. Invariant: a page is
    either on the free list or in exactly one sequence's `pages`.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        page_tokens: int = 16,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        positive_int("kvcache", "num_pages", num_pages)
        positive_int("kvcache", "page_tokens", page_tokens)
        self.config = config
        self.page_tokens = page_tokens
        self.device = torch.device(device) if device is not None else default_device()
        shape = (config.num_layers, num_pages, page_tokens, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_pages(self) -> int:
        return int(self.k.shape[1])

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_free_tokens(self) -> int:
        return self.num_free_pages * self.page_tokens

    @property
    def bytes_per_page(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    def reserve(self, seq: DecodeSequence, num_tokens: int) -> None:
        """Grow `seq` to hold at least `num_tokens` tokens; KVCacheFullError if out of pages."""
        need = self.pages_for(num_tokens) - len(seq.pages)
        if need > len(self._free):
            raise KVCacheFullError(
                f"KV cache: sequence {seq.seq_id} needs {need} more pages of "
                f"{self.page_tokens} tokens, {len(self._free)} free"
            )
        for _ in range(max(need, 0)):
            seq.pages.append(self._free.pop())

    def release(self, seq: DecodeSequence) -> None:
        """Return all of `seq`'s pages to the free list."""
        self._free.extend(reversed(seq.pages))
        seq.pages = []

    def _rows(self, seq: DecodeSequence, start: int, num_tokens: int) -> torch.Tensor:
        """Flat row indices (page * page_tokens + row) of tokens `[start, start + n)`."""
        if start < 0 or start + num_tokens > len(seq.pages) * self.page_tokens:
            raise IndexError(
                f"tokens [{start}, {start + num_tokens}) outside the "
                f"{len(seq.pages) * self.page_tokens} reserved for sequence {seq.seq_id}"
            )
        pos = torch.arange(start, start + num_tokens)
        pages = torch.tensor(seq.pages, dtype=torch.long)[pos // self.page_tokens]
        return (pages * self.page_tokens + pos % self.page_tokens).to(self.device)

    def write(
        self, seq: DecodeSequence, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store layer `layer`'s KV (`[n, num_kv_heads, head_dim]`) of tokens
        `[start, start + n)` (reserve first)."""
        rows = self._rows(seq, start, int(k.shape[0]))
        self.k[layer].view(-1, *self.k.shape[3:])[rows] = k.to(self.k.device, self.k.dtype)
        self.v[layer].view(-1, *self.v.shape[3:])[rows] = v.to(self.v.device, self.v.dtype)

    def read(
        self, seq: DecodeSequence, layer: int, start: int, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of layer `layer`'s KV of tokens `[start, start + num_tokens)`."""
        rows = self._rows(seq, start, num_tokens)
        return (self.k[layer].view(-1, *self.k.shape[3:])[rows],
                self.v[layer].view(-1, *self.v.shape[3:])[rows])

    def load_blocks(
        self, seq: DecodeSequence, layout: KVLayout, blocks: Sequence[object], num_tokens: int
    ) -> None:
        """Copy the first `num_tokens` tokens of KV held in consecutive Full Blocks (a DE
        buffer) into `seq`'s pages (the H2D before decode). Reserves the pages it needs."""
        self.reserve(seq, num_tokens)
        for layer in range(layout.num_layers):
            k, v = layout.gather_layer(blocks, layer, num_tokens)
            self.write(seq, layer, 0, k, v)

    def export_block(
        self, seq: DecodeSequence, layout: KVLayout, block_index: int, out: object
    ) -> None:
        """Write tokens `[i * block_size, (i + 1) * block_size)` of `seq`, all layers, into
        the Full Block buffer `out` (to be persisted; the D2H of paper §5.2)."""
        start = block_index * layout.block_size
        if block_index < 0 or start + layout.block_size > seq.num_kv_tokens:
            raise IndexError(f"block {block_index} of sequence {seq.seq_id} is not complete")
        for layer in range(layout.num_layers):
            k, v = self.read(seq, layer, start, layout.block_size)
            layout.write_layer(out, layer, k, v)


# -- the model -------------------------------------------------------------------------------

class Model:
    """A Llama-family decoder with layer-by-layer prefill and paged-KV decode."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """Check `weights` (HF names) against `config` and place them on `device` in `dtype`."""
        self.config = config
        self.device = torch.device(device) if device is not None else default_device()
        self.dtype = dtype
        want = expected_weight_shapes(config)
        for name, shape in want.items():
            if name not in weights:
                raise WeightsError(f"weights of {config.name}: missing tensor {name!r}")
            if tuple(weights[name].shape) != shape:
                raise WeightsError(f"weights of {config.name}: {name} has shape "
                                   f"{tuple(weights[name].shape)}, expected {shape}")

        def w(name: str) -> torch.Tensor:
            return weights[name].detach().to(self.device, dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        self.lm_head = self.embed if config.is_tied_embeddings else w("lm_head.weight")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            bias = config.has_qkv_bias
            self.layers.append(LayerWeights(
                input_norm=w(p + "input_layernorm.weight"),
                q_proj=w(p + "self_attn.q_proj.weight"),
                k_proj=w(p + "self_attn.k_proj.weight"),
                v_proj=w(p + "self_attn.v_proj.weight"),
                o_proj=w(p + "self_attn.o_proj.weight"),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_proj=w(p + "mlp.gate_proj.weight"),
                up_proj=w(p + "mlp.up_proj.weight"),
                down_proj=w(p + "mlp.down_proj.weight"),
                q_bias=w(p + "self_attn.q_proj.bias") if bias else None,
                k_bias=w(p + "self_attn.k_proj.bias") if bias else None,
                v_bias=w(p + "self_attn.v_proj.bias") if bias else None,
            ))
        hd = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (
            torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        angles = torch.outer(torch.arange(config.max_position_tokens, dtype=torch.float64),
                             inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self._cos = angles.cos().to(self.device, dtype)
        self._sin = angles.sin().to(self.device, dtype)

    @property
    def kv_dtype(self) -> str:
        """Name of the KV dtype (the model dtype), as `KVLayout.dtype` wants it."""
        return next(name for name, dt in KV_DTYPES.items() if dt == self.dtype)

    def kv_layout(self, block_size: int = 64) -> KVLayout:
        """The Full Block layout of this model's KV in its own dtype."""
        return self.config.kv_layout(block_size, self.kv_dtype)

    # -- building blocks -------------------------------------------------------------------
    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return weight * (x.float() * torch.rsqrt(var + self.config.rms_norm_eps)).to(x.dtype)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate `x` (`[n, heads, head_dim]`) by the angles of `positions` (`[n]`)."""
        cos = self._cos[positions].unsqueeze(1)
        sin = self._sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _qkv(
        self, lw: LayerWeights, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        n = x.shape[0]
        q = F.linear(x, lw.q_proj, lw.q_bias).view(n, c.num_attention_heads, c.head_dim)
        k = F.linear(x, lw.k_proj, lw.k_bias).view(n, c.num_kv_heads, c.head_dim)
        v = F.linear(x, lw.v_proj, lw.v_bias).view(n, c.num_kv_heads, c.head_dim)
        return self._rope(q, positions), self._rope(k, positions), v

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_position: int
    ) -> torch.Tensor:
        """Causal attention of queries at positions `first_position + i` over keys `0..T-1`.
        q: `[n, heads, hd]`, k/v: `[T, kv_heads, hd]` -> `[n, heads * hd]`."""
        n, total = q.shape[0], k.shape[0]
        q_pos = torch.arange(first_position, first_position + n, device=q.device)
        mask = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None]
        # enable_gqa: each group of query heads reads its KV head in place (no repeat copy).
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
            enable_gqa=True,
        )
        return out.transpose(0, 1).reshape(n, -1)

    def _mlp_block(self, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        x = self._rms_norm(h, lw.post_norm)
        x = F.linear(F.silu(F.linear(x, lw.gate_proj)) * F.linear(x, lw.up_proj), lw.down_proj)
        return h + x

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self._rms_norm(h, self.norm), self.lm_head)

    def _check_positions(self, num_tokens: int) -> None:
        if num_tokens > self.config.max_position_tokens:
            raise SpecError(f"model[{self.config.name}]", "sequence tokens", num_tokens,
                            f"exceeds max_position_tokens={self.config.max_position_tokens}")

    def _check_ids(self, token_ids: Sequence[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise SpecError(f"model[{self.config.name}]", "token_ids", bad[0],
                            f"outside the vocabulary [0, {self.config.vocab_size})")

    # -- prefill, layer by layer -------------------------------------------------------------
    @torch.inference_mode()
    def begin_prefill(self, token_ids: Sequence[int], num_cached_tokens: int) -> PrefillState:
        """Start prefilling `token_ids[num_cached_tokens:]` after `num_cached_tokens` tokens
        whose KV will be supplied per layer. At least one token must be new (its logits are
        the prefill's output)."""
        ids = tuple(int(t) for t in token_ids)
        if not 0 <= num_cached_tokens < len(ids):
            raise SpecError("prefill", "num_cached_tokens", num_cached_tokens,
                            f"must be in [0, {len(ids)}) for a prompt of {len(ids)} tokens")
        self._check_positions(len(ids))
        self._check_ids(ids[num_cached_tokens:])
        new = torch.tensor(ids[num_cached_tokens:], dtype=torch.long, device=self.device)
        return PrefillState(ids, num_cached_tokens, self.embed[new])

    @torch.inference_mode()
    def prefill_layer(
        self,
        state: PrefillState,
        layer: int,
        cached_k: torch.Tensor | None,
        cached_v: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run layer `layer` (layers go in order) for the new tokens of `state`.

        `cached_k`/`cached_v`: this layer's KV of the cached tokens, `[num_cached, kv_heads,
        head_dim]` on any device (None when nothing is cached). Returns this layer's KV of the
        new tokens, `[num_new, kv_heads, head_dim]` on the model's device (post-RoPE keys, as
        the cache stores them).
        """
        if layer != state.next_layer:
            raise ValueError(f"prefill_layer: expected layer {state.next_layer}, got {layer}")
        c, n_cached = self.config, state.num_cached_tokens
        want = (n_cached, c.num_kv_heads, c.head_dim)
        if n_cached and (cached_k is None or cached_v is None or
                         tuple(cached_k.shape) != want or tuple(cached_v.shape) != want):
            got = None if cached_k is None else tuple(cached_k.shape)
            raise ValueError(f"prefill_layer {layer}: cached KV must be {want}, got {got}")
        lw = self.layers[layer]
        h = state.hidden
        positions = torch.arange(n_cached, n_cached + h.shape[0], device=self.device)
        q, k, v = self._qkv(lw, self._rms_norm(h, lw.input_norm), positions)
        if n_cached:
            assert cached_k is not None and cached_v is not None
            keys = torch.cat([cached_k.to(self.device, self.dtype), k])
            values = torch.cat([cached_v.to(self.device, self.dtype), v])
        else:
            keys, values = k, v
        h = h + F.linear(self._attend(q, keys, values, n_cached), lw.o_proj)
        state.hidden = self._mlp_block(lw, h)
        state.next_layer += 1
        return k, v

    @torch.inference_mode()
    def finish_prefill(self, state: PrefillState) -> torch.Tensor:
        """Logits (`[vocab]`, float32) of the last position, once every layer has run."""
        if state.next_layer != self.config.num_layers:
            raise ValueError(f"finish_prefill after {state.next_layer} of "
                             f"{self.config.num_layers} layers")
        return self._logits(state.hidden[-1:])[0].float()

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: Sequence[int],
        num_cached_tokens: int = 0,
        cached_kv: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """All layers at once: `(logits of the last position, per-layer KV of new tokens)`."""
        state = self.begin_prefill(token_ids, num_cached_tokens)
        new_kv = []
        for layer in range(self.config.num_layers):
            ck, cv = cached_kv[layer] if cached_kv is not None else (None, None)
            new_kv.append(self.prefill_layer(state, layer, ck, cv))
        return self.finish_prefill(state), new_kv

    # -- decode ------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode_step(self, seqs: Sequence[DecodeSequence], cache: KVCache) -> list[int]:
        """Run the pending last token of each sequence, store its KV, and append the next token
        (sampled per `seq.params`). Returns the new tokens in order.

        Before: `cache` holds each sequence's KV for tokens `[0, len - 1)`. After: for
        `[0, len)`, with `len` one larger; finished sequences are marked (`finish_reason`).
        """
        if not seqs:
            return []
        for seq in seqs:
            if seq.is_finished:
                raise ValueError(f"decode_step: sequence {seq.seq_id} is finished")
            self._check_positions(len(seq.token_ids))
            cache.reserve(seq, len(seq.token_ids))
        last = torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.long,
                            device=self.device)
        positions = torch.tensor([s.num_kv_tokens for s in seqs], dtype=torch.long,
                                 device=self.device)
        h = self.embed[last]
        for layer, lw in enumerate(self.layers):
            q, k, v = self._qkv(lw, self._rms_norm(h, lw.input_norm), positions)
            outs = []
            for i, seq in enumerate(seqs):
                pos = seq.num_kv_tokens
                cache.write(seq, layer, pos, k[i : i + 1], v[i : i + 1])
                keys, values = cache.read(seq, layer, 0, pos + 1)
                outs.append(self._attend(q[i : i + 1], keys, values, pos))
            h = h + F.linear(torch.cat(outs), lw.o_proj)
            h = self._mlp_block(lw, h)
        logits = self._logits(h).float()
        tokens = []
        for i, seq in enumerate(seqs):
            tokens.append(seq.sample(logits[i], self.config.eos_token_ids))
        return tokens

    def start_decode(
        self,
        seq_id: int,
        prompt_ids: Sequence[int],
        first_logits: torch.Tensor,
        params: SamplingParams,
    ) -> DecodeSequence:
        """A decode sequence whose first token is sampled from the prefill's last logits."""
        seq = DecodeSequence(seq_id, [int(t) for t in prompt_ids], len(prompt_ids), params)
        seq.sample(first_logits, self.config.eos_token_ids)
        return seq

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        cache: KVCache | None = None,
        seq_id: int = 0,
    ) -> DecodeSequence:
        """Reference path, no external cache: full prefill, then decode to completion.

        The returned sequence still holds its pages in `cache` (so its KV can be exported);
        a private cache is made when none is given.
        """
        if cache is None:
            num_tokens = len(prompt_ids) + params.max_tokens
            cache = KVCache(self.config, num_pages=-(-num_tokens // 16), page_tokens=16,
                            device=self.device, dtype=self.dtype)
        logits, kv = self.prefill(prompt_ids)
        seq = self.start_decode(seq_id, prompt_ids, logits, params)
        cache.reserve(seq, len(prompt_ids))
        for layer, (k, v) in enumerate(kv):
            cache.write(seq, layer, 0, k, v)
        while not seq.is_finished:
            self.decode_step([seq], cache)
        return seq
