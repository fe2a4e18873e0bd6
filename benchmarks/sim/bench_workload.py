"""Workload benchmarks: generator, turn table, loaders. Medians over repeats, ratios vs baselines.

Run: `python benchmarks/sim/bench_workload.py` (about 10 s on 2 cores). Each line prints
ours / baseline: below 1 is faster than the baseline; loaders are compared with bare JSON
parsing, so their ratio is the cost of strict validation (and of hit computation).

1. Synthetic 64K generation (500 trajectories, ~78k turns): the vectorized generator vs a
   per-turn Python loop drawing the same model (baseline).
2. Per-turn arrays: `TurnTable.from_trajectories` vs `Trajectory.turns()` for every trajectory.
3. Trajectory JSONL load (strict validation) vs bare `json.loads` of the same lines.
4. Mooncake load + incremental hits vs bare `json.loads` (the full trace when present, else the
   test excerpt).
"""

from __future__ import annotations

import io
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dualpath.workload.jsonl import parse_trajectories, trajectory_file, write_trajectories
from dualpath.workload.mooncake import parse_mooncake
from dualpath.workload.stats import table2_stats
from dualpath.workload.synthetic import SyntheticParams, generate, generate_table, preset
from dualpath.workload.trajectory import Trajectory, TurnTable

ROOT = Path(__file__).resolve().parents[2]
FULL_TRACE = ROOT.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"
EXCERPT = ROOT / "tests" / "fixtures" / "mooncake_excerpt.jsonl"
REPEATS = 5


def median_s(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def loop_generate(p: SyntheticParams, seed: int) -> list[Trajectory]:
    """Baseline: the generator's model drawn turn by turn in Python (no stratification)."""
    rng = np.random.default_rng(seed)

    def ln(mean: float, sigma: float) -> float:
        return mean * math.exp(sigma * float(rng.standard_normal()) - 0.5 * sigma * sigma)

    out = []
    rho = p.natural_total_append_correlation
    for k in range(p.num_trajectories):
        za, zl = float(rng.standard_normal()), float(rng.standard_normal())
        s = p.append_trajectory_sigma
        level_a = p.append_mean_tokens * math.exp(s * za - 0.5 * s * s)
        s = p.natural_total_sigma
        natural = p.natural_total_mean_tokens * math.exp(
            s * (-rho * za + math.sqrt(1 - rho * rho) * zl) - 0.5 * s * s)
        level_g = ln(p.gen_mean_tokens, p.gen_trajectory_sigma)
        a_list: list[int] = []
        g_list: list[int] = []
        ctx = 0
        i = 0
        while ctx < natural:
            if i == 0:
                a = max(1, round(ln(p.first_append_mean_tokens, p.first_append_sigma)))
            else:
                a = max(1, round(ln(level_a, p.append_turn_sigma)
                                 * (1 + i) ** -p.append_decay_exponent))
            g = max(1, round(ln(level_g, p.gen_turn_sigma)))
            if ctx + a + 1 > p.max_len_tokens:
                break
            g = min(g, p.max_len_tokens - ctx - a)
            a_list.append(a)
            g_list.append(g)
            ctx += a + g
            i += 1
        if not a_list:
            a_list, g_list = [p.max_len_tokens - 1], [1]
        out.append(Trajectory(tuple(a_list), tuple(g_list), str(k)))
    return out


def row(name: str, ours_s: float, base_s: float, unit: str) -> None:
    """One result line: ours, the baseline, and ours / baseline (below 1 means faster)."""
    print(f"  {name:<46} {ours_s * 1e3:8.1f} ms   baseline {base_s * 1e3:8.1f} ms   "
          f"ours/baseline {ours_s / base_s:6.2f}   {unit}")


def main() -> None:
    p = preset("64k")
    table = generate_table(p, 0)
    s = table2_stats(table)
    print(f"workload benchmarks (median of {REPEATS}); 64K preset: {s.num_trajectories} "
          f"trajectories, {s.num_turns} turns, turns {s.turns:.1f}, append "
          f"{s.append_tokens:.0f}, context {s.context_tokens:.0f}")

    ours = median_s(lambda: generate_table(p, 0))
    base = median_s(lambda: loop_generate(p, 0), repeats=3)
    row("generate 64K (vectorized vs per-turn loop)", ours, base,
        f"{s.num_turns / ours / 1e6:.1f} M turns/s")

    trajs = generate(p, 0)
    ours = median_s(lambda: TurnTable.from_trajectories(trajs))
    base = median_s(lambda: [t.turns() for t in trajs], repeats=3)
    row("TurnTable.from_trajectories vs .turns()", ours, base,
        f"{s.num_turns / ours / 1e6:.1f} M turns/s")

    buf = io.StringIO()
    write_trajectories(buf, trajectory_file(trajs, p.max_len_tokens))
    lines = buf.getvalue().splitlines()
    ours = median_s(lambda: parse_trajectories(lines))
    base = median_s(lambda: [json.loads(x) for x in lines])
    row("load trajectory JSONL (strict) vs json.loads", ours, base,
        f"{len(buf.getvalue()) / ours / 1e6:.0f} MB/s")

    path = FULL_TRACE if FULL_TRACE.exists() else EXCERPT
    mc_lines = path.read_text().splitlines()
    ours = median_s(lambda: parse_mooncake(mc_lines), repeats=3)
    base = median_s(lambda: [json.loads(x) for x in mc_lines], repeats=3)
    trace = parse_mooncake(mc_lines)
    row(f"load Mooncake + hits ({trace.num_requests} req) vs json.loads", ours, base,
        f"{trace.num_requests / ours / 1e3:.0f} k req/s, reuse {trace.block_reuse_rate:.1%}")


if __name__ == "__main__":
    main()
