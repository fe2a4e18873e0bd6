"""Table 2 statistics of a set of trajectories, plus the within-trajectory hit rate.

Column semantics (paper Table 2, calibration note). The per-turn columns are averaged per
trajectory first and then over trajectories, as the paper's numbers require: with pooled per-turn
means, Turns x (Append + Gen) would equal Total, but 157 x (429 + 176) = 94,985 is far above the
64K row's Total of 55,958. So:

- turns   = mean over trajectories of T_k
- append  = mean over trajectories of (mean_i A_ki)
- gen     = mean over trajectories of (mean_i g_ki)
- total   = mean over trajectories of sum_i (A_ki + g_ki)
- context = mean over trajectories of (mean_i context_ki), context_ki = sum_{j<i} (A_kj + g_kj)
- hit_rate = sum of hit tokens / sum of prompt tokens over every turn (pooled: the fraction of
  prefill tokens served from the cache), hit = floor(context / block_size) * block_size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from dualpath.workload.trajectory import IntArray, TurnTable


@dataclass(frozen=True, slots=True)
class Table2Stats:
    """Table 2's columns for a trajectory set, plus counts and the block-aligned hit rate."""

    num_trajectories: int
    num_turns: int
    turns: float
    append_tokens: float
    gen_tokens: float
    total_tokens: float
    context_tokens: float
    hit_rate: float
    block_size_tokens: int

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _per_trajectory_mean(values: IntArray, table: TurnTable) -> float:
    sums = np.add.reduceat(values, table.starts[:-1])
    return float(np.mean(sums / table.turns_per_trajectory))


def table2_stats(table: TurnTable) -> Table2Stats:
    """Table 2 statistics of `table` (see the module docstring for each column's definition)."""
    if table.num_trajectories == 0:
        nan = float("nan")
        return Table2Stats(0, 0, nan, nan, nan, nan, nan, nan, table.block_size)
    prompt_sum = int(table.prompt_tokens.sum())
    return Table2Stats(
        num_trajectories=table.num_trajectories,
        num_turns=table.num_turns,
        turns=float(np.mean(table.turns_per_trajectory)),
        append_tokens=_per_trajectory_mean(table.append_tokens, table),
        gen_tokens=_per_trajectory_mean(table.gen_tokens, table),
        total_tokens=float(np.mean(table.total_tokens)),
        context_tokens=_per_trajectory_mean(table.context_tokens, table),
        hit_rate=float(table.hit_tokens.sum()) / prompt_sum,
        block_size_tokens=table.block_size,
    )
