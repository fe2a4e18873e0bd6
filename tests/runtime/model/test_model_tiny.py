"""The layer-by-layer model on tiny random weights: cached-KV prefill == full recompute."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dualpath.core.blocks import block_keys
from dualpath.core.errors import SpecError
from dualpath.runtime.kvlayout import KVLayout
from dualpath.runtime.model.kv_cache import DecodeSequence, KVCache, KVCacheFullError
from dualpath.runtime.model.llama import Model
from dualpath.runtime.model.sampling import SamplingParams
from dualpath.runtime.model.weights import (
    CheckpointError,
    convert_gguf,
    load_checkpoint,
    tiny_config,
    tiny_random_model,
    tiny_random_weights,
)
from dualpath.store import BlockStore

BLOCK = 16


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # Several test processes share two cores; one BLAS thread avoids oversubscription stalls.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> Model:
    return tiny_random_model(seed=0, device="cpu")


def random_ids(seed: int, n: int, vocab: int = 512) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=gen).tolist()


def test_chunked_prefill_with_cached_kv_matches_full_prefill(model: Model) -> None:
    ids = random_ids(1, 100)
    full_logits, full_kv = model.prefill(ids)
    cached: list[tuple[torch.Tensor, torch.Tensor]] = [
        (torch.empty(0, 2, 16), torch.empty(0, 2, 16)) for _ in range(model.config.num_layers)
    ]
    for start, end in [(0, 37), (37, 64), (64, 100)]:
        state = model.begin_prefill(ids[:end], num_cached_tokens=start)
        for layer in range(model.config.num_layers):
            ck, cv = cached[layer]
            nk, nv = model.prefill_layer(state, layer, ck if start else None,
                                         cv if start else None)
            cached[layer] = (torch.cat([ck, nk]), torch.cat([cv, nv]))
        logits = model.finish_prefill(state)
    torch.testing.assert_close(logits, full_logits, rtol=1e-5, atol=1e-5)
    for (k, v), (fk, fv) in zip(cached, full_kv, strict=True):
        torch.testing.assert_close(k, fk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, fv, rtol=1e-5, atol=1e-5)
    assert int(logits.argmax()) == int(full_logits.argmax())


def persist_blocks(seq: DecodeSequence, cache: KVCache, layout: KVLayout,
                   store: BlockStore) -> int:
    """What a DE does during decode: persist every complete Full Block of the sequence."""
    num_blocks = seq.num_kv_tokens // layout.block_size
    keys = block_keys(seq.token_ids[: num_blocks * layout.block_size], layout.block_size)
    buf = bytearray(layout.full_block_bytes)
    for i, key in enumerate(keys):
        cache.export_block(seq, layout, i, buf)
        store.put(key, buf)
    return num_blocks


def generate_from_store(model: Model, prompt: list[int], params: SamplingParams,
                        layout: KVLayout, store: BlockStore) -> tuple[list[int], int]:
    """The cached path: read the prompt's stored prefix, prefill only the rest layer by layer
    with the cached KV supplied per layer, load the whole prompt KV into a fresh paged cache
    (as a DE does from its buffer), decode. Returns (output ids, hit tokens)."""
    keys = block_keys(prompt, layout.block_size)
    num_hit = store.longest_prefix(keys)
    num_hit = min(num_hit, (len(prompt) - 1) // layout.block_size)  # >= 1 token to prefill
    blocks = [bytearray(layout.full_block_bytes) for _ in range(num_hit)]
    for key, buf in zip(keys, blocks, strict=False):
        assert store.get_into(key, buf)
    hit_tokens = num_hit * layout.block_size
    state = model.begin_prefill(prompt, hit_tokens)
    new_kv = []
    for layer in range(layout.num_layers):
        ck, cv = layout.gather_layer(blocks, layer, hit_tokens) if hit_tokens else (None, None)
        new_kv.append(model.prefill_layer(state, layer, ck, cv))
    logits = model.finish_prefill(state)
    cache = KVCache(model.config, num_pages=64, page_tokens=8, device="cpu")
    seq = model.start_decode(1, prompt, logits, params)
    cache.load_blocks(seq, layout, blocks, hit_tokens)
    cache.reserve(seq, len(prompt))
    for layer, (k, v) in enumerate(new_kv):
        cache.write(seq, layer, hit_tokens, k, v)
    while not seq.is_finished:
        model.decode_step([seq], cache)
    return seq.output_ids, hit_tokens


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=20, is_ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.8, top_k=40, top_p=0.9, seed=7,
                   is_ignore_eos=True),
], ids=["greedy", "sampled"])
def test_multi_turn_with_kv_from_store_equals_full_recompute(
    model: Model, tmp_path: Path, params: SamplingParams
) -> None:
    layout = model.kv_layout(BLOCK)
    store = BlockStore(tmp_path, layout.full_block_bytes, is_durable=False)
    turn1 = random_ids(2, 45)
    cache = KVCache(model.config, num_pages=32, page_tokens=8, device="cpu")
    seq1 = model.generate(turn1, params, cache=cache)
    assert len(seq1.output_ids) == 20
    assert persist_blocks(seq1, cache, layout, store) == (45 + 20 - 1) // BLOCK

    turn2 = seq1.token_ids + random_ids(3, 23)
    cached_out, hit_tokens = generate_from_store(model, turn2, params, layout, store)
    assert hit_tokens == 64
    reference = model.generate(turn2, params).output_ids
    assert cached_out == reference
    assert store.counters.num_hits == 4 and store.counters.num_corrupt == 0


def test_batched_decode_equals_one_at_a_time(model: Model) -> None:
    params = SamplingParams(max_tokens=12, is_ignore_eos=True)
    prompts = [random_ids(10 + i, n) for i, n in enumerate([5, 30, 17])]
    alone = [model.generate(p, params).output_ids for p in prompts]
    cache = KVCache(model.config, num_pages=40, page_tokens=4, device="cpu")
    seqs = []
    for i, p in enumerate(prompts):
        logits, kv = model.prefill(p)
        seq = model.start_decode(i, p, logits, params)
        cache.reserve(seq, len(p))
        for layer, (k, v) in enumerate(kv):
            cache.write(seq, layer, 0, k, v)
        seqs.append(seq)
    while not all(s.is_finished for s in seqs):
        model.decode_step([s for s in seqs if not s.is_finished], cache)
    assert [s.output_ids for s in seqs] == alone


def test_eos_stops_unless_ignored(model: Model) -> None:
    prompt = random_ids(4, 20)
    free = model.generate(prompt, SamplingParams(max_tokens=10)).output_ids
    # Make the first token that does not repeat an earlier one the EOS.
    j = next(i for i in range(1, 10) if free[i] not in free[:i])
    eos_model = Model(dataclasses.replace(model.config, eos_token_ids=(free[j],)),
                      tiny_random_weights(model.config, 0), device="cpu")
    stopped = eos_model.generate(prompt, SamplingParams(max_tokens=10))
    assert stopped.output_ids == free[: j + 1] and stopped.finish_reason == "eos"
    full = eos_model.generate(prompt, SamplingParams(max_tokens=10, is_ignore_eos=True))
    assert full.output_ids == free and full.finish_reason == "length"
    one = eos_model.generate(prompt, SamplingParams(max_tokens=1, is_ignore_eos=True))
    assert one.output_ids == free[:1] and one.finish_reason == "length"


def test_sampling_is_seeded_and_varies_with_seed(model: Model) -> None:
    prompt = random_ids(5, 10)
    a = model.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=1))
    b = model.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=1))
    c = model.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=2))
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids


def test_paged_cache_accounting(model: Model) -> None:
    cache = KVCache(model.config, num_pages=4, page_tokens=8, device="cpu")
    a = DecodeSequence(0, [1] * 20, 20, SamplingParams())
    cache.reserve(a, 20)
    assert len(a.pages) == 3 and cache.num_free_pages == 1
    b = DecodeSequence(1, [1] * 9, 9, SamplingParams())
    with pytest.raises(KVCacheFullError, match="2 more pages"):
        cache.reserve(b, 9)
    cache.release(a)
    assert cache.num_free_pages == 4 and a.pages == []
    cache.reserve(b, 9)
    with pytest.raises(IndexError, match="outside"):
        cache.write(b, 0, 10, torch.zeros(7, 2, 16), torch.zeros(7, 2, 16))


def test_export_block_round_trips_layout(model: Model) -> None:
    layout = model.kv_layout(8)
    cache = KVCache(model.config, num_pages=8, page_tokens=4, device="cpu")
    prompt = random_ids(6, 20)
    _, kv = model.prefill(prompt)
    seq = DecodeSequence(0, [*prompt, 1], 20, SamplingParams())
    cache.reserve(seq, 20)
    for layer, (k, v) in enumerate(kv):
        cache.write(seq, layer, 0, k, v)
    buf = bytearray(layout.full_block_bytes)
    cache.export_block(seq, layout, 1, buf)
    for layer, (k, v) in enumerate(kv):
        bk, bv = layout.kv_views(buf, layer)
        assert torch.equal(bk, k[8:16]) and torch.equal(bv, v[8:16])
    with pytest.raises(IndexError, match="not complete"):
        cache.export_block(seq, layout, 2, buf)


def test_prefill_misuse_is_rejected(model: Model) -> None:
    with pytest.raises(SpecError, match="num_cached_tokens"):
        model.begin_prefill([1, 2, 3], 3)
    with pytest.raises(SpecError, match="vocabulary"):
        model.begin_prefill([1, 99999], 0)
    state = model.begin_prefill([1, 2, 3, 4], 2)
    with pytest.raises(ValueError, match="expected layer 0"):
        model.prefill_layer(state, 1, None, None)
    with pytest.raises(ValueError, match="cached KV must be"):
        model.prefill_layer(state, 0, torch.zeros(3, 2, 16), torch.zeros(3, 2, 16))
    with pytest.raises(ValueError, match="after 0 of 4 layers"):
        model.finish_prefill(state)


def write_checkpoint(folder: Path, model_type: str, seed: int) -> dict[str, torch.Tensor]:
    config = dataclasses.replace(tiny_config(), has_qkv_bias=model_type == "qwen2",
                                 is_tied_embeddings=False)
    weights = tiny_random_weights(config, seed)
    folder.mkdir()
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": model_type, "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "eos_token_id": [0, 3],
    }))
    return weights


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_load_checkpoint_folder(tmp_path: Path, model_type: str) -> None:
    weights = write_checkpoint(tmp_path / "ckpt", model_type, seed=3)
    loaded = load_checkpoint(tmp_path / "ckpt", device="cpu")
    assert loaded.config.has_qkv_bias == (model_type == "qwen2")
    assert loaded.config.eos_token_ids == (0, 3)
    direct = Model(loaded.config, weights, device="cpu")
    ids = random_ids(7, 12)
    torch.testing.assert_close(loaded.prefill(ids)[0], direct.prefill(ids)[0])
    assert loaded.config.to_model_spec().kv_bytes_per_token == loaded.kv_layout().kv_bytes_per_token


def test_sliding_window_caps_sequence_length(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "ckpt", "llama", seed=3)
    cfg_path = tmp_path / "ckpt" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg |= {"model_type": "mistral", "sliding_window": 32}
    cfg_path.write_text(json.dumps(cfg))
    model = load_checkpoint(tmp_path / "ckpt", device="cpu")
    assert model.config.max_position_tokens == 32
    with pytest.raises(SpecError, match="max_position_tokens=32"):
        model.begin_prefill(random_ids(9, 40), 0)


def test_bad_checkpoints_name_the_file(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "ckpt", "llama", seed=3)
    cfg = tmp_path / "ckpt" / "config.json"
    cfg.write_text(cfg.read_text().replace('"llama"', '"gpt2"'))
    with pytest.raises(CheckpointError, match=r"config\.json: model_type='gpt2'"):
        load_checkpoint(tmp_path / "ckpt")
    cfg.write_text("{\n  bad")
    with pytest.raises(CheckpointError, match=r"config\.json:2: invalid JSON"):
        load_checkpoint(tmp_path / "ckpt")
    write_checkpoint(tmp_path / "two", "llama", seed=1)
    (tmp_path / "two" / "model.safetensors").unlink()
    save_file({"model.norm.weight": torch.ones(64)}, str(tmp_path / "two" / "x.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor 'model.embed_tokens.weight'"):
        load_checkpoint(tmp_path / "two")


def test_bfloat16_model_and_layout(tmp_path: Path) -> None:
    model = tiny_random_model(seed=0, device="cpu", dtype=torch.bfloat16)
    layout = model.kv_layout(BLOCK)
    assert layout.dtype == "bfloat16" and layout.kv_bytes_per_token_per_layer == 2 * 2 * 16 * 2
    ids = random_ids(8, 40)
    _, kv = model.prefill(ids)
    block = bytearray(layout.full_block_bytes)
    for layer, (k, v) in enumerate(kv):
        layout.write_layer(block, layer, k[:BLOCK], v[:BLOCK])
    state = model.begin_prefill(ids, BLOCK)
    for layer in range(layout.num_layers):
        nk, _ = model.prefill_layer(state, layer, *layout.gather_layer([block], layer, BLOCK))
        torch.testing.assert_close(nk, kv[layer][0][BLOCK:], rtol=0.05, atol=0.05)
    assert model.finish_prefill(state).dtype == torch.float32


def test_convert_rejects_a_non_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match=r"model\.gguf: not a readable GGUF file"):
        convert_gguf(bogus, tmp_path / "out")
    assert not (tmp_path / "out").exists()
