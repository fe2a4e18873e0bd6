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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dualpath.core.errors import DualPathError, SpecError
from dualpath.runtime.kvlayout import KV_DTYPES, KVLayout
from dualpath.runtime.model.kv_cache import DecodeSequence, KVCache
from dualpath.runtime.model.model_config import ModelConfig, default_device
from dualpath.runtime.model.sampling import SamplingParams

ROPE_DTYPE = torch.float32


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
