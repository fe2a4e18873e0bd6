"""KVLayout: Full Block / Layer Block byte layout, zero-copy views, store round trip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.core.errors import SpecError
from dualpath.runtime.kvlayout import KVLayout
from dualpath.store import BlockStore

LAYOUT = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=5, dtype="float32")


def test_sizes_follow_the_paper_layout() -> None:
    assert LAYOUT.kv_bytes_per_token_per_layer == 2 * 2 * 5 * 4
    assert LAYOUT.layer_block_bytes == 4 * 80
    assert LAYOUT.full_block_bytes == 3 * 4 * 80
    assert LAYOUT.layer_byte_range(1) == (320, 640)
    assert KVLayout(30, 64, 3, 64, "bfloat16").kv_bytes_per_token == 23_040  # SmolLM2 bf16


def test_layer_block_is_a_contiguous_slice_with_k_then_v_rows() -> None:
    buf = np.zeros(LAYOUT.full_block_bytes, dtype=np.uint8)
    gen = torch.Generator().manual_seed(0)
    kvs = [(torch.randn(4, 2, 5, generator=gen), torch.randn(4, 2, 5, generator=gen))
           for _ in range(3)]
    for layer, (k, v) in enumerate(kvs):
        LAYOUT.write_layer(memoryview(buf), layer, k, v)
    flat = buf.view(np.float32).reshape(3, 4, 20)  # [layer, token, K(2x5) then V(2x5)]
    for layer, (k, v) in enumerate(kvs):
        assert np.array_equal(flat[layer, :, :10], k.reshape(4, 10).numpy())
        assert np.array_equal(flat[layer, :, 10:], v.reshape(4, 10).numpy())
        start, stop = LAYOUT.layer_byte_range(layer)
        lb = LAYOUT.layer_block_view(memoryview(buf)[start:stop])
        assert torch.equal(lb[:, 0], k) and torch.equal(lb[:, 1], v)


def test_views_share_memory() -> None:
    buf = bytearray(LAYOUT.full_block_bytes)
    k, v = LAYOUT.kv_views(buf, 2, num_tokens=3)
    k.fill_(1.5)
    v.fill_(-2.0)
    values = np.frombuffer(buf, dtype=np.float32).reshape(3, 4, 20)
    assert (values[2, :3, :10] == 1.5).all() and (values[2, :3, 10:] == -2.0).all()
    assert (values[2, 3] == 0).all() and (values[:2] == 0).all()


def test_scatter_then_gather_across_blocks_and_partial_tail() -> None:
    blocks = [bytearray(LAYOUT.full_block_bytes) for _ in range(3)]
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(10, 2, 5, generator=gen)
    v = torch.randn(10, 2, 5, generator=gen)
    LAYOUT.scatter_layer(blocks, 1, k[:6], v[:6])
    LAYOUT.scatter_layer(blocks, 1, k[6:], v[6:], start_token=6)
    gk, gv = LAYOUT.gather_layer(blocks, 1, num_tokens=10)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    ok, ov = LAYOUT.gather_layer(blocks, 0, num_tokens=10)
    assert not ok.any() and not ov.any()


def test_round_trip_through_the_store(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, LAYOUT.full_block_bytes, is_durable=False)
    src = torch.randn(3, 4, 2, 2, 5, generator=torch.Generator().manual_seed(2))
    block = bytearray(LAYOUT.full_block_bytes)
    LAYOUT.full_view(block).copy_(src)
    store.put(b"x" * 16, block)
    out = torch.empty(LAYOUT.full_block_bytes, dtype=torch.uint8)
    assert store.get_into(b"x" * 16, out.numpy())
    assert torch.equal(LAYOUT.full_view(out), src)


def test_invalid_layouts_and_shapes_are_rejected() -> None:
    with pytest.raises(SpecError, match="dtype"):
        KVLayout(1, 4, 1, 4, dtype="int8")
    with pytest.raises(SpecError, match="block_size"):
        KVLayout(1, 0, 1, 4)
    with pytest.raises(ValueError, match="bytes"):
        LAYOUT.full_view(bytearray(10))
    with pytest.raises(IndexError, match="layer"):
        LAYOUT.layer_view(bytearray(LAYOUT.full_block_bytes), 3)
    with pytest.raises(ValueError, match=r"\[n, 2, 5\]"):
        LAYOUT.write_layer(
            bytearray(LAYOUT.full_block_bytes), 0, torch.zeros(4, 5), torch.zeros(4, 5)
        )
    with pytest.raises(IndexError, match="outside a block"):
        LAYOUT.write_layer(bytearray(LAYOUT.full_block_bytes), 0, torch.zeros(3, 2, 5),
                           torch.zeros(3, 2, 5), start_token=2)


@settings(max_examples=40, deadline=None)
@given(
    block_size=st.integers(1, 9),
    pieces=st.lists(st.integers(1, 12), min_size=1, max_size=5),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
)
def test_scatter_in_pieces_then_gather_is_identity(
    block_size: int, pieces: list[int], dtype: str
) -> None:
    layout = KVLayout(num_layers=2, block_size=block_size, num_kv_heads=1, head_dim=2,
                      dtype=dtype)
    total = sum(pieces)
    blocks = [bytearray(layout.full_block_bytes) for _ in range(layout.num_blocks(total))]
    k = torch.arange(total * 2, dtype=torch.float32).view(total, 1, 2).to(layout.torch_dtype)
    v = -k
    start = 0
    for n in pieces:
        layout.scatter_layer(blocks, 1, k[start : start + n], v[start : start + n], start)
        start += n
    gk, gv = layout.gather_layer(blocks, 1, total)
    assert torch.equal(gk, k) and torch.equal(gv, v)
