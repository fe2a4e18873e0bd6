"""The connector's P/D roles on the scheduler side (`plan.Planner` as prefill and as decode)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath.core.blocks import block_keys
from dualpath.core.errors import SpecError
from dualpath.integrations.vllm.connector.key_namespace import namespace_key
from dualpath.integrations.vllm.connector.plan import Planner
from dualpath.integrations.vllm.manifest import LoadReport, RouteParams
from dualpath.store import BlockStore

BS = 4
NS = namespace_key("test-model", "float32", BS)
TOKENS = list(range(100, 118))  # 4 full blocks and a 2-token tail; 5 blocks in all


def route(hit: int, pe: int, tokens: int = 0) -> RouteParams:
    return RouteParams(xfer="x1", de="127.0.0.1:9", hit_blocks=hit, pe_blocks=pe, tokens=tokens)


def planner(tmp_path: Path, role: str, async_loads: bool = False) -> tuple[Planner, BlockStore]:
    store = BlockStore(tmp_path, 8, is_durable=False)
    return Planner(BS, NS, store.contains, role=role, async_loads=async_loads), store


def test_prefill_splits_the_hit_between_the_store_and_the_decode_side(tmp_path: Path) -> None:
    p, _ = planner(tmp_path, "prefill")
    p.add_request("r", TOKENS, route(hit=3, pe=1))
    # The router's hit count is trusted (a vanished block is a load error, not a re-count).
    assert p.match("r", 0) == 3 * BS
    p.after_alloc("r", 3 * BS)
    p.schedule_new("r", [10, 11, 12, 13, 14], 3 * BS, len(TOKENS) - 3 * BS)
    plan = p.take_plan()
    (pe_load,) = plan.loads
    (de_load,) = plan.remote_loads
    keys = block_keys(TOKENS, BS, parent=NS)
    assert (pe_load.first_block, pe_load.block_ids, pe_load.keys) == (0, (10,), (keys[0],))
    assert de_load.xfer == "x1" and de_load.de == "127.0.0.1:9"
    assert (de_load.blocks.first_block, de_load.blocks.block_ids) == (1, (11, 12))
    assert de_load.blocks.keys == tuple(keys[1:3])
    # Prefill completes in this step: push what the decode side lacks (not its own 1..2).
    (push,) = plan.pushes
    assert push.block_indices == (0, 3, 4) and push.block_ids == (10, 11, 12, 13, 14)
    assert push.hit_blocks == 3
    assert plan.saves == []  # the decode instance persists
    done = route(3, 1, tokens=len(TOKENS)).to_params()
    done["dualpath"]["loads"] = {"pe_blocks": 1, "de_blocks": 2, "recomputed_blocks": 0}
    assert p.finished_params("r") == done
    assert RouteParams.from_params(done) == route(3, 1, tokens=len(TOKENS))


@pytest.mark.parametrize("async_loads", [False, True])
def test_prefill_pushes_the_blocks_its_own_prefix_cache_had(
        tmp_path: Path, async_loads: bool) -> None:
    """vLLM's prefix cache on the prefill instance holds blocks 0..1; the router read the
    whole hit on the DE side (pe=0). The decode instance stages only what the prefill asks
    for, blocks 2..3, so blocks 0..1 are pushed (they were left out once, and the decode
    instance then recomputed the whole prompt)."""
    p, _ = planner(tmp_path, "prefill", async_loads=async_loads)
    p.add_request("r", TOKENS, route(hit=4, pe=0))
    assert p.match("r", 2 * BS) == 2 * BS
    ids = [10, 11, 12, 13, 14]
    p.after_alloc("r", 2 * BS, ids)
    if async_loads:
        (de_load,) = p.take_plan().async_remote_loads
    p.schedule_new("r", ids, 4 * BS, len(TOKENS) - 4 * BS)
    plan = p.take_plan()
    if not async_loads:
        (de_load,) = plan.remote_loads
    assert (de_load.blocks.first_block, de_load.blocks.block_ids) == (2, (12, 13))
    (push,) = plan.pushes
    assert push.block_indices == (0, 1, 4) and push.hit_blocks == 4


def test_prefill_background_loads_are_planned_at_allocation(tmp_path: Path) -> None:
    p, _ = planner(tmp_path, "prefill", async_loads=True)
    p.add_request("r", TOKENS, route(hit=3, pe=1))
    assert p.is_async("r")
    assert p.match("r", 0) == 3 * BS
    with pytest.raises(ValueError, match="block ids"):
        p.after_alloc("r", 3 * BS)
    p.after_alloc("r", 3 * BS, [10, 11, 12])  # vLLM: the request waits for its KV
    plan = p.take_plan()
    (pe_load,) = plan.async_loads
    (de_load,) = plan.async_remote_loads
    assert (pe_load.first_block, pe_load.block_ids) == (0, (10,))
    assert (de_load.blocks.first_block, de_load.blocks.block_ids) == (1, (11, 12))
    assert plan.loads == [] and plan.remote_loads == [] and plan.pushes == []
    # vLLM asks again only when that load failed (or a preemption): recompute, never a loop.
    assert p.match("r", 0) == 0
    # Loaded: scheduled with the hit computed; nothing is loaded again, the prefill pushes.
    p.schedule_new("r", [10, 11, 12, 13, 14], 3 * BS, len(TOKENS) - 3 * BS)
    plan = p.take_plan()
    assert plan.async_loads == [] and plan.loads == [] and plan.remote_loads == []
    assert [x.block_indices for x in plan.pushes] == [(0, 3, 4)]
    # A request without the router's orders (or on another role) loads in its step.
    q, _ = planner(tmp_path / "q", "decode", async_loads=True)
    q.add_request("r", TOKENS, route(hit=3, pe=1))
    assert not q.is_async("r")


@pytest.mark.parametrize("async_loads", [False, True])
@pytest.mark.parametrize(("failed", "report"), [
    ((), (2, 2, 0)),  # every load in
    ((13,), (2, 1, 1)),  # the last DE-side block failed
    ((12, 13), (2, 0, 2)),  # both DE-side blocks
    ((11,), (1, 0, 3)),  # a PE-side block: vLLM recomputes from there on, the DE side too
    ((99,), (2, 2, 0)),  # another request's block
])
def test_the_load_report_counts_what_loaded_per_side(
        tmp_path: Path, async_loads: bool, failed: tuple[int, ...],
        report: tuple[int, int, int]) -> None:
    p, _ = planner(tmp_path, "prefill", async_loads=async_loads)
    p.add_request("r", TOKENS, route(hit=4, pe=2))
    assert p.match("r", 0) == 4 * BS
    blocks = [10, 11, 12, 13, 14]
    p.after_alloc("r", 4 * BS, blocks)
    p.schedule_new("r", blocks, 4 * BS, len(TOKENS) - 4 * BS)
    p.take_plan()
    p.load_errors(failed)  # vLLM's invalid_block_ids of that step
    got = LoadReport.from_params(p.finished_params("r"))
    assert got == LoadReport(*report)
    assert p.load_report("r").to_dict() == dict(zip(
        ("pe_blocks", "de_blocks", "recomputed_blocks"), report, strict=True))
    assert LoadReport.from_params({}) is None


def test_prefill_pushes_once_and_again_after_a_recompute(tmp_path: Path) -> None:
    p, _ = planner(tmp_path, "prefill")
    p.add_request("r", TOKENS, route(hit=2, pe=0))
    p.match("r", 0)
    p.after_alloc("r", 2 * BS)
    p.schedule_new("r", [1, 2, 3, 4, 5], 8, 6)  # a chunk: 8 + 6 = 14 of 18 tokens
    first = p.take_plan()
    assert first.pushes == [] and len(first.remote_loads) == 1
    assert p.finished_params("r") is None  # nothing pushed yet
    p.schedule_cached("r", None, is_resumed=False, num_computed_tokens=14,
                      num_scheduled_tokens=4)
    assert [x.block_indices for x in p.take_plan().pushes] == [(2, 3, 4)]
    # vLLM moved the computed tokens back (a failed load): the push is planned again.
    p.schedule_cached("r", None, is_resumed=False, num_computed_tokens=4,
                      num_scheduled_tokens=14)
    assert len(p.take_plan().pushes) == 1
    p.schedule_cached("r", None, is_resumed=False, num_computed_tokens=18,
                      num_scheduled_tokens=1)
    assert p.take_plan().pushes == []


def test_decode_loads_all_but_the_last_prompt_token_from_staging(tmp_path: Path) -> None:
    d, store = planner(tmp_path, "decode")
    d.add_request("r", list(TOKENS), route(hit=3, pe=1, tokens=len(TOKENS)))
    assert d.match("r", 0) == len(TOKENS) - 1
    d.after_alloc("r", len(TOKENS) - 1)
    d.schedule_new("r", [20, 21, 22, 23, 24], len(TOKENS) - 1, 1)
    plan = d.take_plan()
    (x,) = plan.xfer_loads
    assert (x.xfer, x.first_block, x.block_ids) == ("x1", 0, (20, 21, 22, 23, 24))
    assert plan.loads == [] and plan.remote_loads == []
    (save,) = plan.saves  # the full prompt blocks are persisted here
    assert save.block_ids == (20, 21, 22, 23)


def test_decode_without_a_matching_transfer_falls_back_to_the_store(tmp_path: Path) -> None:
    d, store = planner(tmp_path, "decode")
    for key in block_keys(TOKENS, BS, parent=NS)[:2]:
        store.put(key, bytes(8))
    # The prefill side reports a different prompt length: not ours to load.
    d.add_request("r", list(TOKENS), route(hit=2, pe=2, tokens=len(TOKENS) + 1))
    assert d.match("r", 0) == 2 * BS
    d.after_alloc("r", 2 * BS)
    d.schedule_new("r", [1, 2, 3, 4, 5], 2 * BS, len(TOKENS) - 2 * BS)
    plan = d.take_plan()
    assert plan.xfer_loads == [] and plan.remote_loads == [] and len(plan.loads) == 1


def test_single_instance_role_ignores_route_params(tmp_path: Path) -> None:
    b, _ = planner(tmp_path, "both")
    b.add_request("r", TOKENS, route(hit=3, pe=0))
    assert b.match("r", 0) == 0  # nothing stored; the route is not trusted here
    assert b.finished_params("r") is None


def test_route_params_round_trip_and_refuse_bad_fields() -> None:
    r = route(4, 1, tokens=9)
    assert RouteParams.from_params(r.to_params()) == r
    assert RouteParams.from_params({"other": 1}) is None
    with pytest.raises(SpecError, match="pe_blocks"):
        route(2, 3)
    with pytest.raises(SpecError, match="malformed"):
        RouteParams.from_params({"dualpath": {"xfer": "a"}})
    with pytest.raises(SpecError, match="role"):
        Planner(BS, NS, lambda k: False, role="router")
