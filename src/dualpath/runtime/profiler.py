"""Measure one engine of the runtime: the step costs `dualpath profile` writes to a profile.

Times the same calls the engines make, on one thread (as a node runs torch):
- a prefill pass: `begin_prefill` then every layer of every sequence of the batch back to back
  (`prefill_layer` with that layer's cached KV, as `PrefillEngine._forward` runs a pass), over a
  grid of (cached, new, batch);
- a decode step: `decode_step` of `batch` sequences of `context` tokens in a paged `KVCache`
  (as `DecodeEngine._step`);
- copy rates: one Full Block copied in memory, and written to / read from a `BlockStore` in a
  temporary folder (the storage the runtime's NICs are emulated over);
- turns through the whole process path (`time_turns`): one agent's turns, one at a time, on
  an emulated cluster with unpaced I/O, each timed from its submission to its first token and
  to the next turn's submission (what the control plane adds beyond the step costs).

Each point is the median of `repeats` timings after one warm-up. Nothing is fitted here
(`dualpath.plan.step_profile` fits and writes the file).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from dualpath.core.step_grid import StepGrid
from dualpath.runtime.model.kv_cache import DecodeSequence, KVCache
from dualpath.runtime.model.sampling import SamplingParams
from dualpath.store import BlockStore

if TYPE_CHECKING:
    from dualpath.runtime.run_config import RunConfig


DEFAULT_GRID = StepGrid(prefill_cached=(0, 256, 1024), prefill_new=(16, 64, 256),
                        prefill_batch=(1, 2), decode_batch=(1, 4, 16),
                        decode_context=(64, 512, 1536))
"""About 5 s on the tiny model and 2-3 minutes on SmolLM2 here."""


def num_points(grid: StepGrid) -> int:
    """`measure`'s points: the grid's steps and the copy rates."""
    return grid.num_steps + 1


QUICK_GRID = StepGrid(prefill_cached=(0, 512), prefill_new=(16, 128), prefill_batch=(1, 2),
                      decode_batch=(1, 8), decode_context=(64, 512), repeats=3)
"""A few seconds on the tiny model (tests, smoke runs)."""


@dataclass
class Measurements:
    """Raw timings (seconds) of one engine."""

    prefill: list[dict[str, float]] = field(default_factory=list)
    """`{cached, new, batch, seconds}` per point."""
    decode: list[dict[str, float]] = field(default_factory=list)
    """`{batch, context, seconds}` per point."""
    rates: dict[str, float] = field(default_factory=dict)
    """Bytes per second: `memory_copy`, `store_write`, `store_read` of Full Blocks."""
    kv_bytes_per_token: int = 0
    full_block_bytes: int = 0
    threads: int = 1


def _median_time(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up: allocator, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _prefill_pass(model: Any, prompts: Sequence[Sequence[int]], cached: int,
                  cached_kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    states = [model.begin_prefill(p, cached) for p in prompts]
    for layer in range(model.config.num_layers):
        k, v = cached_kv[layer] if cached else (None, None)
        for st in states:
            model.prefill_layer(st, layer, k, v)
    for st in states:
        model.finish_prefill(st)


def _decode_step(model: Any, batch: int, context: int, page_tokens: int) -> Callable[[], object]:
    """A step of `batch` fresh sequences of `context` tokens (each timing call makes new ones,
    so every step sees the same context)."""
    cfg = model.config
    pages = batch * (-(-(context + 2) // page_tokens))
    cache = KVCache(cfg, num_pages=pages, page_tokens=page_tokens, device=model.device,
                    dtype=model.dtype)
    ids = [(7 * i + 3) % cfg.vocab_size for i in range(context)]
    params = SamplingParams(max_tokens=1 << 20, is_ignore_eos=True)

    def step() -> object:
        seqs = []
        for i in range(batch):
            seq = DecodeSequence(i, list(ids), context - 1, params)
            cache.reserve(seq, context)
            seqs.append(seq)
        out = model.decode_step(seqs, cache)
        for seq in seqs:
            cache.release(seq)
        return out

    return step


def measure(model: Any, grid: StepGrid, block_size: int = 64,
            on_point: Callable[[str], None] | None = None) -> Measurements:
    """Time `model` over `grid` on one torch thread; `on_point(label)` after each point."""
    tick = on_point or (lambda _label: None)
    cfg = model.config
    layout = model.kv_layout(block_size)
    out = Measurements(kv_bytes_per_token=int(layout.kv_bytes_per_token),
                       full_block_bytes=int(layout.full_block_bytes))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out.threads = 1
    try:
        with torch.inference_mode():
            _measure_prefill(model, grid, out, tick)
            for batch in grid.decode_batch:
                for context in grid.decode_context:
                    if context + 2 > cfg.max_position_tokens:
                        tick("decode")
                        continue
                    step = _decode_step(model, batch, context, page_tokens=16)
                    t = _median_time(step, grid.repeats)
                    out.decode.append({"batch": batch, "context": context, "seconds": t})
                    tick(f"decode b={batch} ctx={context}")
        out.rates = _copy_rates(int(layout.full_block_bytes), grid.repeats)
        tick("copy rates")
    finally:
        torch.set_num_threads(threads)
    return out


def _measure_prefill(model: Any, grid: StepGrid, out: Measurements,
                     tick: Callable[[str], None]) -> None:
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    for cached in grid.prefill_cached:
        cached_kv = [
            (torch.randn((cached, cfg.num_kv_heads, cfg.head_dim), generator=gen).to(
                model.device, model.dtype),
             torch.randn((cached, cfg.num_kv_heads, cfg.head_dim), generator=gen).to(
                model.device, model.dtype))
            for _ in range(cfg.num_layers)
        ] if cached else []
        for new in grid.prefill_new:
            for batch in grid.prefill_batch:
                if cached + new > cfg.max_position_tokens:
                    tick("prefill")
                    continue
                prompts = [[(11 * i + 5 * b + 1) % cfg.vocab_size for i in range(cached + new)]
                           for b in range(batch)]
                t = _median_time(partial(_prefill_pass, model, prompts, cached, cached_kv),
                                 grid.repeats)
                out.prefill.append({"cached": cached, "new": new, "batch": batch, "seconds": t})
                tick(f"prefill c={cached} n={new} b={batch}")


def _copy_rates(block_bytes: int, repeats: int) -> dict[str, float]:
    """Full Blocks (64 of them, at least 4 MiB) copied in memory and through a `BlockStore`."""
    count = max(64, -(-(4 << 20) // block_bytes))
    src = torch.randint(0, 255, (count, block_bytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_s = _median_time(lambda: dst.copy_(src), repeats)
    with tempfile.TemporaryDirectory(prefix="dualpath-profile-") as tmp:
        store = BlockStore(tmp, block_bytes, is_durable=False)  # as the runtime opens it
        keys = [bytes([i % 256, i // 256]) * 16 for i in range(count)]
        start = time.perf_counter()
        for i, key in enumerate(keys):
            store.put(key, src[i].numpy().tobytes())
        write_s = time.perf_counter() - start
        buf = torch.empty(block_bytes, dtype=torch.uint8).numpy()
        start = time.perf_counter()
        for key in keys:
            store.get_into(key, buf)
        read_s = time.perf_counter() - start
    total = float(count * block_bytes)
    return {"memory_copy": total / copy_s, "store_write": total / write_s,
            "store_read": total / read_s}


TURN_SHAPE = (128, 64, 4)
"""`time_turns`' agent: its first turn appends this many tokens, every later one the second
number (the previous turn's Full Blocks are its hit), and each generates the third."""


def time_turns(cfg: RunConfig, num_turns: int, num_warmup: int = 2,
               on_turn: Callable[[str], None] | None = None) -> list[dict[str, float]]:
    """Time `num_turns` turns of one agent through an emulated cluster of `cfg` (start it with
    unpaced I/O: the oracle mode), one turn at a time, after `num_warmup` untimed ones.

    A row per timed turn: its `prompt`, `hit` and `gen` tokens, and, in seconds after its
    submission, when its first token came (`first_token_s`, stamped by its decode engine) and
    when the agent's next turn was submitted (`next_submit_s`; the driver submits it as soon
    as the turn's `TurnDone` reaches it). Raises `RunError` as `replay` does."""
    from dualpath.runtime.agent_replay import TurnRecord, agents_from_lengths, replay
    from dualpath.runtime.emulated_cluster import Cluster

    tick = on_turn or (lambda _label: None)
    first, append, gen = TURN_SHAPE
    total = num_warmup + num_turns + 1  # the last timed turn needs a next submission
    agents = agents_from_lengths([([first] + [append] * (total - 1), [gen] * total)],
                                 _vocab_size(cfg), cfg.seed)

    def done(rec: TurnRecord) -> None:
        tick(f"turn {rec.turn_index + 1}/{total}")

    with Cluster(cfg) as cluster:
        result = replay(cluster, agents, on_turn=done)
    recs = sorted(result.turns, key=lambda r: r.turn_index)
    return [
        {"prompt": r.prompt_tokens, "hit": r.hit_tokens, "gen": len(r.output_ids),
         "first_token_s": r.first_token_at - r.submitted_at,
         "next_submit_s": nxt.submitted_at - r.submitted_at}
        for r, nxt in zip(recs[num_warmup:-1], recs[num_warmup + 1:], strict=True)
    ]


def _vocab_size(cfg: RunConfig) -> int:
    from dualpath.runtime.model.model_source import model_config

    return int(model_config(cfg.model).vocab_size)
