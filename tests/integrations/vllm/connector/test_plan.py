"""The vLLM connector's scheduler side (`connector.plan`) against a real BlockStore."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath.core.blocks import block_keys
from dualpath.integrations.vllm.connector.key_namespace import namespace_key
from dualpath.integrations.vllm.connector.plan import Planner
from dualpath.integrations.vllm.connector.step_plan import (
    BACKGROUND_LOAD_THREADS,
    storage_read_disciplines,
)
from dualpath.store import BlockStore

BS = 4
NS = namespace_key("test-model", "float32", BS)


def make(tmp_path: Path) -> tuple[Planner, BlockStore]:
    store = BlockStore(tmp_path, 8, is_durable=False)
    return Planner(BS, NS, store.contains), store


def store_blocks(store: BlockStore, tokens: list[int], n: int) -> None:
    for key in block_keys(tokens, BS, parent=NS)[:n]:
        store.put(key, bytes(8))


def test_keys_are_the_core_prefix_chain_from_the_namespace(tmp_path: Path) -> None:
    planner, _ = make(tmp_path)
    tokens = list(range(100, 111))  # 2 full blocks and a partial one
    planner.add_request("r", tokens)
    planner.schedule_new("r", [7, 3, 9], 0, len(tokens))
    (save,) = planner.take_plan().saves
    assert save.keys == tuple(block_keys(tokens, BS, parent=NS))
    assert save.block_ids == (7, 3) and save.first_block == 0
    assert block_keys(tokens, BS, parent=namespace_key("other-model", "float32", BS)) \
        != list(save.keys)


def test_match_reports_stored_blocks_after_the_local_ones(tmp_path: Path) -> None:
    planner, store = make(tmp_path)
    tokens = list(range(14))  # 3 full blocks; 13 tokens before the last
    planner.add_request("r", tokens)
    assert planner.match("r", 0) == 0
    store_blocks(store, tokens, 2)
    assert planner.match("r", 0) == 8
    assert planner.match("r", 4) == 4  # block 0 computed locally (vLLM's prefix cache)
    assert planner.match("r", 8) == 0
    store_blocks(store, tokens, 3)
    assert planner.match("r", 0) == 12


def test_match_leaves_one_token_to_compute(tmp_path: Path) -> None:
    planner, store = make(tmp_path)
    tokens = list(range(8))  # exactly 2 blocks, both stored
    store_blocks(store, tokens, 2)
    planner.add_request("r", tokens)
    assert planner.match("r", 0) == 4


def test_match_stops_at_the_first_missing_block(tmp_path: Path) -> None:
    planner, store = make(tmp_path)
    tokens = list(range(20))
    keys = block_keys(tokens, BS, parent=NS)
    store.put(keys[0], bytes(8))
    store.put(keys[2], bytes(8))
    planner.add_request("r", tokens)
    assert planner.match("r", 0) == 4


def test_a_hit_becomes_a_load_of_the_allocated_blocks(tmp_path: Path) -> None:
    planner, store = make(tmp_path)
    tokens = list(range(14))
    store_blocks(store, tokens, 3)
    planner.add_request("r", tokens)
    assert planner.match("r", 4) == 8
    planner.after_alloc("r", 8)
    planner.schedule_new("r", [5, 6, 7, 8], 12, 2)
    plan = planner.take_plan()
    (load,) = plan.loads
    assert load.first_block == 1 and load.block_ids == (6, 7)
    assert load.keys == tuple(block_keys(tokens, BS, parent=NS)[1:3])
    assert planner.take_plan().is_empty


def test_after_alloc_must_match_the_last_hit(tmp_path: Path) -> None:
    planner, _ = make(tmp_path)
    planner.add_request("r", list(range(10)))
    assert planner.match("r", 0) == 0
    with pytest.raises(ValueError, match="load 4 tokens"):
        planner.after_alloc("r", 4)


def test_saves_follow_prefill_chunks_and_decode(tmp_path: Path) -> None:
    planner, _ = make(tmp_path)
    tokens = list(range(10))  # the live token list vLLM appends outputs to
    planner.add_request("r", tokens)
    planner.schedule_new("r", [0, 1, 2], 0, 6)  # chunk 1: tokens 0..5
    assert [(s.first_block, s.block_ids) for s in planner.take_plan().saves] == [(0, (0,))]
    planner.schedule_cached("r", None, is_resumed=False, num_computed_tokens=6,
                            num_scheduled_tokens=4)  # chunk 2: tokens 6..9
    assert [(s.first_block, s.block_ids) for s in planner.take_plan().saves] == [(1, (1,))]
    # Decode: outputs appended; position 10 (token 10 sampled) then position 11.
    tokens.append(50)
    planner.schedule_cached("r", None, is_resumed=False, num_computed_tokens=10,
                            num_scheduled_tokens=1)
    assert planner.take_plan().saves == []
    tokens.append(51)
    planner.schedule_cached("r", [4], is_resumed=False, num_computed_tokens=11,
                            num_scheduled_tokens=1)
    (save,) = planner.take_plan().saves
    assert save.first_block == 2 and save.block_ids == (2,)
    assert save.keys[0] == block_keys(tokens, BS, parent=NS)[2]


def test_computed_tokens_moved_back_saves_the_blocks_again(tmp_path: Path) -> None:
    """A block that failed to load is recomputed in a later step and must be saved then."""
    planner, _ = make(tmp_path)
    tokens = list(range(13))
    planner.add_request("r", tokens)
    planner.schedule_new("r", [0, 1, 2, 3], 8, 5)
    assert [s.first_block for s in planner.take_plan().saves] == [0]
    # vLLM truncated computed tokens to block 1 (its load failed) and reschedules the rest.
    planner.schedule_cached("r", None, is_resumed=False, num_computed_tokens=4,
                            num_scheduled_tokens=9)
    (save,) = planner.take_plan().saves
    assert (save.first_block, save.block_ids) == (1, (1, 2))


def test_resumed_request_replaces_its_blocks(tmp_path: Path) -> None:
    planner, _ = make(tmp_path)
    tokens = list(range(9))
    planner.add_request("r", tokens)
    planner.schedule_new("r", [0, 1, 2], 0, 9)
    planner.take_plan()
    planner.schedule_cached("r", [10, 11, 12], is_resumed=True, num_computed_tokens=0,
                            num_scheduled_tokens=9)  # preempted, blocks freed, recomputed
    (save,) = planner.take_plan().saves
    assert save.block_ids == (10, 11)
    planner.finish("r")
    assert not planner.has_request("r")
    planner.schedule_cached("r", None, is_resumed=False, num_computed_tokens=9,
                            num_scheduled_tokens=1)
    assert planner.take_plan().is_empty


def test_model_identity_names_the_weights_not_the_path(tmp_path: Path) -> None:
    """The same weights at two paths (two hosts' mounts) share a namespace; other weights,
    or another config, do not; a hub id is itself."""
    from dualpath.integrations.vllm.connector.key_namespace import SAMPLE_BYTES, model_identity

    def folder(name: str, weights: bytes, config: str = '{"hidden_size": 8}') -> str:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(config)
        (d / "model.safetensors").write_bytes(weights)
        (d / "README.md").write_text(name)  # not part of the identity
        return str(d)

    weights = bytes(range(256)) * (3 * SAMPLE_BYTES // 256)
    a = model_identity(folder("a", weights))
    assert model_identity(folder("b", weights)) == a
    tail_changed = weights[:-1] + b"\x01"
    assert model_identity(folder("c", tail_changed)) != a
    assert model_identity(folder("d", weights, '{"hidden_size": 16}')) != a
    assert model_identity("HuggingFaceTB/SmolLM2-135M-Instruct") == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_with_several_ranks_a_loading_step_saves_nothing_of_its_request(
        tmp_path: Path) -> None:
    """TP/PP: a load that failed on one rank corrupts every rank's KV computed in that step,
    and the others cannot know; so the request's blocks are saved from its next step on."""
    store = BlockStore(tmp_path, 8, is_durable=False)
    tokens = list(range(14))  # 3 full blocks
    store_blocks(store, tokens, 1)
    plans = []
    for num_shards in (1, 2):
        planner = Planner(BS, NS, store.contains, num_shards=num_shards)
        planner.add_request("r", tokens)
        assert planner.match("r", 0) == 4
        planner.after_alloc("r", 4)
        planner.schedule_new("r", [5, 6, 7, 8], 0, 12)  # block 0 loaded, 1-2 computed
        first = planner.take_plan()
        planner.schedule_cached("r", None, is_resumed=False, num_computed_tokens=12,
                                num_scheduled_tokens=2)
        plans.append((first, planner.take_plan()))
    (one, next_one), (two, next_two) = plans
    assert [s.block_ids for s in one.saves] == [(5, 6, 7)] and next_one.saves == []
    assert len(two.loads) == 1 and two.saves == []
    assert [s.block_ids for s in next_two.saves] == [(5, 6, 7)]


def test_storage_read_disciplines_follow_the_load_mode() -> None:
    """What a vLLM profile records for the simulator: background loads share a prefill node's
    NIC among as many requests as the loader has threads; in-step loads and the decode side's
    stages are served in order."""
    background = storage_read_disciplines(True)
    assert background["pe"] == {"discipline": "shared",
                                "max_in_flight": BACKGROUND_LOAD_THREADS}
    assert background["de"] == {"discipline": "fifo"}
    assert storage_read_disciplines(False)["pe"] == {"discipline": "fifo"}
