"""KV through the PE read path, through the DE read path, and no cache at all give the same
tokens as a full recompute (tiny random model, greedy, fp32), through the real engines."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath.runtime.agent_replay import AgentScript, RunResult, agents_from_lengths, replay
from dualpath.runtime.emulated_cluster import Cluster
from dualpath.runtime.model.sampling import SamplingParams
from dualpath.runtime.model.weights import tiny_random_model
from dualpath.runtime.run_config import RunConfig

# Two agents, three turns each: turn 2 and 3 prompts extend the previous context, so they hit.
TURNS = [([300, 40, 70], [8, 8, 40]), ([200, 100, 5], [5, 30, 3])]


def reference(agents: list[AgentScript]) -> dict[int, list[tuple[int, ...]]]:
    """Every turn fully recomputed in one process with `Model.generate`."""
    model = tiny_random_model(0)
    out: dict[int, list[tuple[int, ...]]] = {}
    for a in agents:
        context: list[int] = []
        out[a.agent_id] = []
        for append, gen in zip(a.appends, a.gen_tokens, strict=True):
            prompt = context + list(append)
            seq = model.generate(prompt, SamplingParams(max_tokens=gen, is_ignore_eos=True))
            out[a.agent_id].append(tuple(seq.output_ids))
            context = prompt + seq.output_ids
    return out


def run(tmp_path: Path, **overrides: object) -> RunResult:
    fields: dict[str, object] = {
        "mode": "dualpath",
        "store_root": str(tmp_path / "store"),
        "launch": "thread",
        "num_prefill_nodes": 1,
        "num_decode_nodes": 1,
        "engines_per_node": 1,
        "buffer_bytes": 8 << 20,
        "hbm_bytes": 16 << 20,
        "transfer_kind": "shm",
    }
    fields.update(overrides)
    cfg = RunConfig(**fields)  # type: ignore[arg-type]
    cluster = Cluster(cfg)
    agents = agents_from_lengths(TURNS, cluster.vocab_size, seed=0)
    return replay(cluster, agents, timeout_s=120)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def cnic_bytes(r: RunResult, node: int, port: str) -> int:
    """Bytes through the compute NICs of a node's engines in one direction."""
    (stats,) = [n for n in r.nodes if n.node == node]
    return sum(v for k, v in stats.port_bytes.items() if k.endswith(f"cnic.{port}"))


def node_bytes(r: RunResult, node: int, path: str) -> int:
    (stats,) = [n for n in r.nodes if n.node == node]
    return stats.bytes_by_path.get(path, 0)


@pytest.fixture(scope="module")
def expected() -> dict[int, list[tuple[int, ...]]]:
    return reference(agents_from_lengths(TURNS, tiny_random_model(0).config.vocab_size, 0))


def test_pe_read_path_matches_full_recompute(
    tmp_path: Path, expected: dict[int, list[tuple[int, ...]]]
) -> None:
    r = run(tmp_path, path_mode="pe")
    assert r.outputs == expected
    b = r.bytes_by_path()
    assert r.num_hit_tokens > 0 and b["pe_read"] == r.num_hit_tokens * 1024
    assert "de_read" not in b and "de_to_pe" not in b
    # PE path: hit and miss KV both go to the DE buffer, through the DE engine's CNIC too.
    assert b["pe_to_de"] >= b["pe_read"]
    de_copies = node_bytes(r, 1, "h2d") + node_bytes(r, 1, "d2h")
    assert cnic_bytes(r, node=1, port="rx") == b["pe_to_de"] + de_copies
    assert r.store_counters()["num_corrupt"] == 0


def test_de_read_path_matches_full_recompute(
    tmp_path: Path, expected: dict[int, list[tuple[int, ...]]]
) -> None:
    r = run(tmp_path, path_mode="de")
    assert r.outputs == expected
    b = r.bytes_by_path()
    assert r.num_hit_tokens > 0 and b["de_read"] == r.num_hit_tokens * 1024
    assert "pe_read" not in b
    # DE path: the hit KV crosses to the PE layer by layer; only miss KV comes back.
    assert b["de_to_pe"] == b["de_read"]
    de_copies = node_bytes(r, 1, "h2d") + node_bytes(r, 1, "d2h")
    assert cnic_bytes(r, node=1, port="tx") == b["de_to_pe"] + de_copies
    assert b["pe_to_de"] < b["de_to_pe"] + (r.num_prompt_tokens - r.num_hit_tokens) * 1024 * 2


def test_no_cache_matches_and_reads_nothing(
    tmp_path: Path, expected: dict[int, list[tuple[int, ...]]]
) -> None:
    r = run(tmp_path, is_cache_enabled=False, mode="basic")
    assert r.outputs == expected
    assert r.num_hit_tokens == 0
    b = r.bytes_by_path()
    assert "pe_read" not in b and "de_read" not in b and b["snic_write"] > 0


def test_corrupt_block_is_a_miss_and_recomputed(
    tmp_path: Path, expected: dict[int, list[tuple[int, ...]]]
) -> None:
    """Blocks that fail their checksum are counted, recomputed, and the tokens do not change."""
    first = run(tmp_path, path_mode="pe")
    assert first.outputs == expected
    # Flip one payload byte in every stored block; the second run's prompts hit all of them.
    for blk in (tmp_path / "store").rglob("*.blk"):
        data = bytearray(blk.read_bytes())
        data[-1] ^= 0xFF
        blk.write_bytes(bytes(data))
    second = run(tmp_path, path_mode="de")
    assert second.outputs == expected
    assert second.store_counters()["num_corrupt"] > 0


def test_chunked_prefill_matches_full_recompute_and_ships_each_block_once(
    tmp_path: Path, expected: dict[int, list[tuple[int, ...]]]
) -> None:
    """A 48-token cap per forward pass chunks every prompt (chunk ends not block aligned);
    later chunks reuse the KV of the hit and of earlier chunks from the PE buffer."""
    r = run(tmp_path, path_mode="pe", max_batch_tokens=48)
    assert r.outputs == expected
    counters = r.nodes[0].engine_counters
    assert counters["num_chunked_entries"] >= sum(
        (t.prompt_tokens - t.hit_tokens - 1) // 48 for t in r.turns
    )
    # PE path: every prompt block reaches the DE buffer exactly once, whatever the chunking.
    num_blocks = sum(-(-t.prompt_tokens // 64) for t in r.turns)
    assert r.bytes_by_path()["pe_to_de"] == num_blocks * 64 * 1024


def test_quota_chunks_a_long_prompt_on_the_de_path(
    tmp_path: Path, expected: dict[int, list[tuple[int, ...]]]
) -> None:
    """A compute quota below one 300-token pass (cost-model estimate) chunks the prompt by
    binary search; DE-side hits read into the PE buffer serve every chunk."""
    r = run(tmp_path, path_mode="de", compute_quota_s=0.002, estimator="cost-model")
    assert r.outputs == expected
    assert r.nodes[0].engine_counters["num_chunked_entries"] > 0
    assert r.bytes_by_path()["de_to_pe"] == r.bytes_by_path()["de_read"]


def test_a_quota_below_the_fixed_cost_still_moves_a_block_per_pass(
    tmp_path: Path, expected: dict[int, list[tuple[int, ...]]]
) -> None:
    """Nothing fits a 1 us quota: every pass runs one block of the head request (the progress
    floor), never packing a second request."""
    r = run(tmp_path, path_mode="pe", compute_quota_s=1e-6, estimator="cost-model")
    assert r.outputs == expected
    c = r.nodes[0].engine_counters
    assert c["num_prefill_passes"] == c["num_prefill_entries"]
    blocks_to_compute = sum(-(-(t.prompt_tokens - t.hit_tokens) // 64) for t in r.turns)
    assert c["num_prefill_passes"] == blocks_to_compute
