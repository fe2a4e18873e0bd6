"""Table 2 statistics of a set of trajectories, plus the within-trajectory hit rate.

Column semantics (paper Table 2, calibration note), inferred from the paper's own numbers:

- Append and Gen are averaged per trajectory first, then over trajectories. Pooled over all turns
  they could not be: Turns x (Append + Gen) would then equal Total, but for the 64K row
  157 x (429 + 176) = 94,985, far above its Total of 55,958 (agents with long appends run few
  turns, and each agent counts once).
- Context is pooled over every turn (the mean context of all requests a replay sends). For the
  64K row it is 32,721, almost exactly MaxLen / 2 = 32,768: the many-turn agents that dominate
  the pool grow to MaxLen; a per-trajectory mean would sit near Total / 2 = 27,979 instead.

So, for trajectories k with turns i:

- turns   = mean_k T_k
- append  = mean_k (mean_i A_ki)          gen = mean_k (mean_i g_ki)
- total   = mean_k sum_i (A_ki + g_ki)
- context = sum_ki context_ki / sum_k T_k, context_ki = sum_{j<i} (A_kj + g_kj)
- hit_rate = sum_ki hit_ki / sum_ki prompt_ki (pooled: the fraction of prompt tokens served from
  the cache), hit = floor(context / block_size) * block_size.

The paper quotes 98.7% for the 64K set as 1 - Append/Context; the measured pooled hit rate differs
from that shortcut (pooled appends are shorter than per-trajectory ones, and block alignment loses
about half a block per turn), so both are reported.
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

    @property
    def paper_hit_rate(self) -> float:
        """The paper's shortcut 1 - Append/Context (98.7% for its 64K row)."""
        return 1.0 - self.append_tokens / self.context_tokens

    def to_dict(self) -> dict[str, float | int]:
        d: dict[str, float | int] = asdict(self)
        d["paper_hit_rate"] = self.paper_hit_rate
        return d


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
        context_tokens=float(table.context_tokens.mean()),
        hit_rate=float(table.hit_tokens.sum()) / prompt_sum,
        block_size_tokens=table.block_size,
    )
