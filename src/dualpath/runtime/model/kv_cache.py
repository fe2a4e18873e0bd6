"""A DE's paged KV cache in engine memory (`KVCache`) and the sequences decoding in it
(`DecodeSequence`: token ids, pages, sampling and when to finish)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dualpath.core.errors import DualPathError
from dualpath.core.validate import positive_int
from dualpath.runtime.kvlayout import KVLayout
from dualpath.runtime.model.model_config import ModelConfig, default_device
from dualpath.runtime.model.sampling import SamplingParams, TokenLogprobs, sample


class KVCacheFullError(DualPathError):
    """The paged KV cache has too few free pages for a request."""


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
