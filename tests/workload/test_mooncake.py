import json
from pathlib import Path

import pytest

from dualpath.workload.mooncake import (
    MooncakeRequest,
    MooncakeTrace,
    PrefixStore,
    load_mooncake,
    to_trajectories,
)
from dualpath.workload.trace_errors import TraceFormatError

FIXTURE = Path(__file__).parent.parent / "fixtures" / "mooncake_excerpt.jsonl"
FULL = Path(__file__).parents[3] / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"


def _req(ts_ms: int, inp: int, out: int, ids: list[int]) -> str:
    return json.dumps({"timestamp": ts_ms, "input_length": inp, "output_length": out,
                       "hash_ids": ids})


def _write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_hits_are_incremental_prefix_hits(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        _req(0, 1000, 10, [0, 1]),
        _req(2000, 1300, 5, [0, 1, 2]),   # full prefix hit: 2 blocks, 1024 tokens
        _req(1000, 600, 5, [0, 9]),       # earlier timestamp: replayed second, hits block 0
        _req(3000, 1100, 5, [5, 1, 2]),   # block 1 is stored but not as a prefix: no hit
        _req(4000, 900, 5, [0, 1]),       # hit capped at the input length
    )
    t = load_mooncake(path)
    assert [r.timestamp_s for r in t.requests] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert t.hit_blocks.tolist() == [0, 1, 2, 0, 2]
    assert t.hit_tokens.tolist() == [0, 512, 1024, 0, 900]
    assert t.block_reuse_rate == pytest.approx(5 / 12)
    assert t.token_hit_rate == pytest.approx((512 + 1024 + 900) / (1000 + 600 + 1300 + 1100 + 900))


def test_prefix_store() -> None:
    s = PrefixStore()
    assert s.lookup_then_store([1, 2, 3]) == 0
    assert s.lookup_then_store([1, 2, 4]) == 2
    assert s.lookup_then_store([4, 1]) == 2  # 4 was stored by the previous visit
    assert s.lookup_then_store([9, 1]) == 0
    assert len(s) == 5


def test_fixture_loads() -> None:
    t = load_mooncake(FIXTURE)
    assert t.num_requests == 200
    assert t.hit_blocks[0] == 0
    # Every request shares block 0 with the first one.
    assert (t.hit_blocks[1:] >= 1).all()
    assert 0 < t.block_reuse_rate < 1


@pytest.mark.skipif(not FULL.exists(), reason="full Mooncake trace not present")
def test_full_trace_reuse() -> None:
    t = load_mooncake(FULL)
    assert t.num_requests == 12031
    assert t.block_reuse_rate == pytest.approx(0.37, abs=0.01)
    assert t.input_tokens.mean() == pytest.approx(12035, abs=1)
    assert t.output_tokens.mean() == pytest.approx(343, abs=1)


@pytest.mark.parametrize(
    ("line", "field", "why"),
    [
        ('{"timestamp": 0, "input_length": 10,', None, "invalid JSON"),
        (_req(0, -5, 1, []), "input_length", ">= 1"),
        (_req(0, 10, -1, [0]), "output_length", ">= 1"),
        (_req(-1, 10, 1, [0]), "timestamp", ">= 0"),
        ('{"timestamp": 0, "output_length": 1, "hash_ids": [0]}', "input_length", "missing"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0], "x": 1}',
         "x", "unknown field"),
        (_req(0, 1025, 1, [0, 1]), "hash_ids", "ceil(1025/512) = 3"),
        (_req(0, 100, 1, [0, 1]), "hash_ids", "needs"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}',
         "hash_ids", "integers"),
        ('{"timestamp": 0, "input_length": 10.0, "output_length": 1, "hash_ids": [0]}',
         "input_length", "integer"),
    ],
)
def test_bad_lines(tmp_path: Path, line: str, field: str | None, why: str) -> None:
    path = _write(tmp_path, _req(0, 10, 1, [0]), line)
    with pytest.raises(TraceFormatError) as info:
        load_mooncake(path)
    assert (info.value.line, info.value.field) == (2, field)
    assert str(info.value).startswith(f"{path}:2: ")
    assert why in str(info.value)


def test_conversion_chains_extending_requests() -> None:
    reqs = [
        MooncakeRequest(0.0, 1000, 100, (0, 1)),
        MooncakeRequest(1.0, 1500, 50, (0, 1, 2)),      # extends #0: 1000 + 100 + 400 new
        MooncakeRequest(2.0, 700, 20, (7, 8)),           # unrelated: new trajectory
        MooncakeRequest(3.0, 1560, 30, (0, 1, 2, 3)),    # extends #1 by 10 tokens
        MooncakeRequest(4.0, 1100, 30, (0, 1, 5)),       # extends #0's blocks, but #0's chain
                                                         # moved on: new trajectory
        MooncakeRequest(5.0, 710, 30, (7, 9)),           # shares #2's full block but drops
                                                         # its output: not a continuation
    ]
    tf = to_trajectories(MooncakeTrace.from_requests(reqs), source="x")
    got = [(t.append_tokens, t.gen_tokens) for t in tf.trajectories]
    assert got == [
        ((1000, 400, 10), (100, 50, 30)),
        ((700,), (20,)),
        ((1100,), (30,)),
        ((710,), (30,)),
    ]
    assert tf.meta["num_requests"] == 6


def test_conversion_of_fixture_keeps_every_request() -> None:
    t = load_mooncake(FIXTURE)
    tf = to_trajectories(t)
    assert sum(x.num_turns for x in tf.trajectories) == t.num_requests
    prompts = sorted(int(p) for x in tf.trajectories for p in x.prompt_tokens())
    assert prompts == sorted(t.input_tokens.tolist())
