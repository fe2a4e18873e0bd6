"""The KV byte layout shared by the store, the buffers, the transfers and the model.

A Full Block is `[num_layers, block_size, kv_bytes_per_token_per_layer]` bytes, layer-major and
contiguous, so the Layer Block of layer `l` is the contiguous byte range
`[l * layer_block_bytes, (l + 1) * layer_block_bytes)` and concatenating the Layer Blocks of all
layers yields the Full Block (paper §4.1). Within a Layer Block each token has one row: the K of
all KV heads (`num_kv_heads * head_dim` values) then the V, in the KV dtype:

    Full Block  = [layer 0 | layer 1 | ... | layer L-1]            (Layer Blocks, contiguous)
    Layer Block = [token 0 | token 1 | ... | token block_size-1]   (rows)
    row         = [K: kv_heads x head_dim | V: kv_heads x head_dim] (KV dtype)

Storage I/O moves Full Blocks; streaming between DRAM and engine memory moves Layer Blocks. The
helpers here view a flat uint8 buffer (a `torch.Tensor`, `memoryview`, `bytearray` or numpy
array) as typed `(k, v)` tensors without copying, and copy one layer's KV in or out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dualpath.core.errors import SpecError
from dualpath.core.validate import positive_int

KV_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

Buffer = torch.Tensor | memoryview | bytearray | Any
"""A flat byte buffer: a uint8 `torch.Tensor` (any device) or a writable buffer-protocol object."""


def as_byte_tensor(buf: Buffer) -> torch.Tensor:
    """A flat uint8 tensor sharing memory with `buf` (no copy)."""
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8:
            buf = buf.view(torch.uint8) if buf.is_contiguous() else buf.contiguous().view(
                torch.uint8
            )
        return buf.reshape(-1)
    mv = memoryview(buf)
    if mv.readonly:
        raise ValueError("KV buffer must be writable (got a read-only buffer)")
    if mv.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mv.cast("B"), dtype=torch.uint8)


@dataclass(frozen=True)
class KVLayout:
    """Byte layout of Full Blocks and Layer Blocks for one model and KV dtype."""

    num_layers: int
    block_size: int
    """Tokens per block (the paper's example: 64)."""
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    """KV dtype name, one of KV_DTYPES (fp32 by default so cached == recomputed bit for bit)."""

    def __post_init__(self) -> None:
        owner = "kvlayout"
        positive_int(owner, "num_layers", self.num_layers)
        positive_int(owner, "block_size", self.block_size)
        positive_int(owner, "num_kv_heads", self.num_kv_heads)
        positive_int(owner, "head_dim", self.head_dim)
        if self.dtype not in KV_DTYPES:
            raise SpecError(owner, "dtype", self.dtype, f"must be one of {sorted(KV_DTYPES)}")

    # -- sizes -----------------------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.dtype]

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def kv_values_per_token_per_layer(self) -> int:
        """K then V of all KV heads: `2 * num_kv_heads * head_dim` values."""
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return self.kv_values_per_token_per_layer * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_per_layer * self.num_layers

    @property
    def layer_block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token_per_layer

    @property
    def full_block_bytes(self) -> int:
        return self.num_layers * self.layer_block_bytes

    def layer_byte_range(self, layer: int) -> tuple[int, int]:
        """`(start, stop)` byte offsets of layer `layer`'s Layer Block inside a Full Block."""
        self._check_layer(layer)
        return layer * self.layer_block_bytes, (layer + 1) * self.layer_block_bytes

    def num_blocks(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens (a trailing partial block counts)."""
        return -(-num_tokens // self.block_size)

    # -- views (no copies) -----------------------------------------------------------------
    def full_view(self, full_block: Buffer) -> torch.Tensor:
        """`full_block` as `[num_layers, block_size, 2, num_kv_heads, head_dim]` in the KV dtype."""
        raw = self._sized(full_block, self.full_block_bytes, "Full Block")
        return raw.view(self.torch_dtype).view(
            self.num_layers, self.block_size, 2, self.num_kv_heads, self.head_dim
        )

    def layer_block_view(self, layer_block: Buffer) -> torch.Tensor:
        """A standalone Layer Block as `[block_size, 2, num_kv_heads, head_dim]`."""
        raw = self._sized(layer_block, self.layer_block_bytes, "Layer Block")
        return raw.view(self.torch_dtype).view(
            self.block_size, 2, self.num_kv_heads, self.head_dim
        )

    def layer_view(self, full_block: Buffer, layer: int) -> torch.Tensor:
        """Layer `layer` of a Full Block as `[block_size, 2, num_kv_heads, head_dim]`."""
        start, stop = self.layer_byte_range(layer)
        raw = self._sized(full_block, self.full_block_bytes, "Full Block")
        return self.layer_block_view(raw[start:stop])

    def kv_views(
        self, full_block: Buffer, layer: int, num_tokens: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(k, v)`, each `[num_tokens, num_kv_heads, head_dim]`, viewing the first `num_tokens`
        rows of layer `layer` (strided views into the block; no copy)."""
        n = self.block_size if num_tokens is None else num_tokens
        self._check_tokens(0, n)
        rows = self.layer_view(full_block, layer)[:n]
        return rows[:, 0], rows[:, 1]

    # -- copies ----------------------------------------------------------------------------
    def write_layer(
        self,
        full_block: Buffer,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        start_token: int = 0,
    ) -> None:
        """Copy one layer's `(k, v)` (`[n, num_kv_heads, head_dim]`, any device or dtype) into
        rows `[start_token, start_token + n)` of `full_block`'s Layer Block `layer`."""
        n = self._check_kv(k, v)
        self._check_tokens(start_token, n)
        rows = self.layer_view(full_block, layer)[start_token : start_token + n]
        rows[:, 0].copy_(k)
        rows[:, 1].copy_(v)

    def gather_layer(
        self,
        blocks: Sequence[Buffer],
        layer: int,
        num_tokens: int,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenate layer `layer` of consecutive Full Blocks into one contiguous
        `[num_tokens, 2, num_kv_heads, head_dim]` tensor (`out`, on any device, else a new CPU
        tensor) and return its `(k, v)` views. This is the copy that moves a request's cached
        Layer Blocks into engine memory (H2D on a GPU)."""
        if num_tokens > len(blocks) * self.block_size:
            raise ValueError(
                f"num_tokens={num_tokens} exceeds {len(blocks)} blocks x {self.block_size} tokens"
            )
        shape = (num_tokens, 2, self.num_kv_heads, self.head_dim)
        if out is None:
            out = torch.empty(shape, dtype=self.torch_dtype)
        elif tuple(out.shape) != shape or out.dtype != self.torch_dtype:
            raise ValueError(f"out must be {shape} {self.torch_dtype}, got "
                             f"{tuple(out.shape)} {out.dtype}")
        for i in range(self.num_blocks(num_tokens)):
            start = i * self.block_size
            n = min(self.block_size, num_tokens - start)
            out[start : start + n].copy_(self.layer_view(blocks[i], layer)[:n])
        return out[:, 0], out[:, 1]

    def scatter_layer(
        self,
        blocks: Sequence[Buffer],
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        start_token: int = 0,
    ) -> None:
        """Write one layer's KV of tokens `[start_token, start_token + n)` of a sequence into the
        consecutive Full Blocks holding that sequence (block `i` holds tokens
        `[i * block_size, (i + 1) * block_size)`)."""
        n = self._check_kv(k, v)
        end = start_token + n
        if end > len(blocks) * self.block_size:
            raise ValueError(f"tokens up to {end} exceed {len(blocks)} blocks")
        pos = start_token
        while pos < end:
            i, off = divmod(pos, self.block_size)
            m = min(self.block_size - off, end - pos)
            src = slice(pos - start_token, pos - start_token + m)
            self.write_layer(blocks[i], layer, k[src], v[src], start_token=off)
            pos += m

    # -- checks ----------------------------------------------------------------------------
    def _sized(self, buf: Buffer, nbytes: int, what: str) -> torch.Tensor:
        raw = as_byte_tensor(buf)
        if raw.numel() != nbytes:
            raise ValueError(f"{what} buffer has {raw.numel()} bytes, layout needs {nbytes}")
        return raw

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer={layer} outside [0, {self.num_layers})")

    def _check_tokens(self, start: int, n: int) -> None:
        if start < 0 or n < 0 or start + n > self.block_size:
            raise IndexError(
                f"tokens [{start}, {start + n}) outside a block of {self.block_size}"
            )

    def _check_kv(self, k: torch.Tensor, v: torch.Tensor) -> int:
        want = (self.num_kv_heads, self.head_dim)
        if k.dim() != 3 or tuple(k.shape[1:]) != want or k.shape != v.shape:
            raise ValueError(
                f"k and v must both be [n, {want[0]}, {want[1]}], got "
                f"{tuple(k.shape)} and {tuple(v.shape)}"
            )
        return int(k.shape[0])
