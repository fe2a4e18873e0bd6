"""Agent trajectories (paper A.3): turns of appended tokens A_i and generated tokens g_i.

Replay model. The prompt of turn i is its context (A_1, G_1, ..., A_{i-1}, G_{i-1}) followed by
A_i; the engine then generates exactly g_i tokens. So, with 0-based turn index i,

    context_i = sum_{j<i} (A_j + g_j)     prompt_i = context_i + A_i     total = sum_j (A_j + g_j)

Hits occur only within a trajectory, and the whole context was stored when the previous turn
finished (its generated tokens are persisted by the decode engine), so the hit of turn i is the
block-aligned context: floor(context_i / block_size) * block_size. The first turn never hits.

A `Trajectory` stores only the two length sequences; everything else derives from them.
`TurnTable` flattens many trajectories into numpy arrays for the simulator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from dualpath.core.blocks import DEFAULT_BLOCK_SIZE
from dualpath.core.errors import SpecError

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


class Turn(NamedTuple):
    """One turn of a trajectory with its derived lengths (all in tokens)."""

    turn_index: int
    append_tokens: int
    gen_tokens: int
    context_tokens: int
    prompt_tokens: int
    hit_tokens: int

    @property
    def miss_tokens(self) -> int:
        """Prompt tokens that must be prefilled (not loaded from the cache)."""
        return self.prompt_tokens - self.hit_tokens


def _check_lengths(owner: str, field: str, values: Sequence[int]) -> None:
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SpecError(owner, f"{field}[{i}]", v, "must be an integer >= 1")


@dataclass(frozen=True, slots=True)
class Trajectory:
    """An agent's turns: `append_tokens[i]` = A_i, `gen_tokens[i]` = g_i (both >= 1).

    Invariant: both tuples have the same length >= 1. Every turn appends at least one token and
    generates at least one token, so prompts strictly grow within a trajectory.
    """

    append_tokens: tuple[int, ...]
    gen_tokens: tuple[int, ...]
    trajectory_id: str = ""

    def __post_init__(self) -> None:
        owner = f"Trajectory({self.trajectory_id!r})"
        if len(self.append_tokens) != len(self.gen_tokens):
            raise SpecError(
                owner, "gen_tokens", len(self.gen_tokens),
                f"needs one entry per turn ({len(self.append_tokens)} append_tokens)",
            )
        if not self.append_tokens:
            raise SpecError(owner, "append_tokens", (), "needs at least one turn")
        # Fast path: numpy checks 100k turns in microseconds; the slow loop only names the culprit.
        for field, values in (("append_tokens", self.append_tokens),
                              ("gen_tokens", self.gen_tokens)):
            if not all(type(v) is int for v in values) or min(values) < 1:
                _check_lengths(owner, field, values)

    @classmethod
    def from_lengths(
        cls, append_tokens: Sequence[int] | IntArray, gen_tokens: Sequence[int] | IntArray,
        trajectory_id: str = "",
    ) -> Trajectory:
        """Build from any int sequences (numpy arrays included), converting to Python ints."""
        return cls(
            tuple(int(a) for a in append_tokens), tuple(int(g) for g in gen_tokens),
            trajectory_id,
        )

    @property
    def num_turns(self) -> int:
        return len(self.append_tokens)

    @property
    def total_tokens(self) -> int:
        """Final trajectory length: sum of A_i + g_i."""
        return sum(self.append_tokens) + sum(self.gen_tokens)

    def context_tokens(self) -> IntArray:
        """context_i for every turn (0 for the first)."""
        a = np.asarray(self.append_tokens, dtype=np.int64)
        g = np.asarray(self.gen_tokens, dtype=np.int64)
        ctx = np.zeros(len(a), dtype=np.int64)
        np.cumsum(a[:-1] + g[:-1], out=ctx[1:])
        return ctx

    def prompt_tokens(self) -> IntArray:
        """prompt_i = context_i + A_i for every turn."""
        return self.context_tokens() + np.asarray(self.append_tokens, dtype=np.int64)

    def hit_tokens(self, block_size: int = DEFAULT_BLOCK_SIZE) -> IntArray:
        """Block-aligned within-trajectory hit of every turn."""
        return hit_tokens_of(self.context_tokens(), block_size)

    def turns(self, block_size: int = DEFAULT_BLOCK_SIZE) -> list[Turn]:
        """Every turn with its derived lengths."""
        ctx = self.context_tokens()
        hit = hit_tokens_of(ctx, block_size)
        return [
            Turn(i, a, g, int(c), int(c) + a, int(h))
            for i, (a, g, c, h) in enumerate(
                zip(self.append_tokens, self.gen_tokens, ctx, hit, strict=True)
            )
        ]


def hit_tokens_of(context_tokens: IntArray, block_size: int = DEFAULT_BLOCK_SIZE) -> IntArray:
    """floor(context / block_size) * block_size, elementwise."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise SpecError("workload", "block_size", block_size, "must be an integer >= 1")
    return (context_tokens // block_size) * block_size


@dataclass(frozen=True, slots=True, eq=False)
class TurnTable:
    """Every turn of many trajectories as flat, aligned int64 arrays (one row per turn).

    Rows are ordered by trajectory, then turn. `starts[k]:starts[k+1]` are the rows of
    trajectory k (`starts` has one extra final entry). Hits use `block_size`. Compared by
    identity (arrays have no single truth value); treat the arrays as read-only.
    """

    trajectory_index: IntArray
    turn_index: IntArray
    append_tokens: IntArray
    gen_tokens: IntArray
    context_tokens: IntArray
    starts: IntArray
    block_size: int = DEFAULT_BLOCK_SIZE

    @classmethod
    def from_trajectories(
        cls, trajectories: Sequence[Trajectory], block_size: int = DEFAULT_BLOCK_SIZE
    ) -> TurnTable:
        """Flatten `trajectories` (vectorized: no per-turn Python work beyond reading tuples)."""
        counts = np.fromiter((t.num_turns for t in trajectories), np.int64, len(trajectories))
        starts = np.zeros(len(trajectories) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        n = int(starts[-1])
        a = np.fromiter(
            (x for t in trajectories for x in t.append_tokens), np.int64, n
        )
        g = np.fromiter((x for t in trajectories for x in t.gen_tokens), np.int64, n)
        traj = np.repeat(np.arange(len(trajectories), dtype=np.int64), counts)
        turn = np.arange(n, dtype=np.int64) - np.repeat(starts[:-1], counts)
        return cls.from_arrays(traj, turn, a, g, starts, block_size)

    @classmethod
    def from_arrays(
        cls, trajectory_index: IntArray, turn_index: IntArray, append_tokens: IntArray,
        gen_tokens: IntArray, starts: IntArray, block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> TurnTable:
        """Derive contexts from per-turn lengths already laid out by trajectory, then turn."""
        step = append_tokens + gen_tokens
        cum = np.cumsum(step) - step  # exclusive prefix sum over all rows
        # Each row's context is the prefix sum since its trajectory's first row.
        context = cum - np.repeat(cum[starts[:-1]], np.diff(starts))
        hit_tokens_of(context, block_size)  # validates block_size
        return cls(trajectory_index, turn_index, append_tokens, gen_tokens, context, starts,
                   block_size)

    @property
    def num_trajectories(self) -> int:
        return len(self.starts) - 1

    @property
    def num_turns(self) -> int:
        return len(self.append_tokens)

    @property
    def prompt_tokens(self) -> IntArray:
        return self.context_tokens + self.append_tokens

    @property
    def hit_tokens(self) -> IntArray:
        return hit_tokens_of(self.context_tokens, self.block_size)

    @property
    def turns_per_trajectory(self) -> IntArray:
        return np.diff(self.starts)

    @property
    def total_tokens(self) -> IntArray:
        """Final length of each trajectory."""
        step = self.append_tokens + self.gen_tokens
        return np.add.reduceat(step, self.starts[:-1]) if self.num_turns else step[:0]

    def trajectory(self, k: int, trajectory_id: str = "") -> Trajectory:
        """Trajectory k back as a `Trajectory`."""
        lo, hi = int(self.starts[k]), int(self.starts[k + 1])
        return Trajectory.from_lengths(
            self.append_tokens[lo:hi], self.gen_tokens[lo:hi], trajectory_id
        )
