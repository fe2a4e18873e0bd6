"""The turns a simulation replays, as flat numpy arrays (one row per turn, agents contiguous).

Built from `dualpath.workload` (a `TurnTable` of trajectories, or a Mooncake trace) or from plain
lists in tests. Hits are given per turn: block-aligned stored prefixes, never above the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dualpath.core.errors import SpecError
from dualpath.workload.mooncake import MooncakeTrace
from dualpath.workload.trajectory import TurnTable

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, eq=False)
class Workload:
    """Rows `starts[k]:starts[k+1]` are agent k's turns in order.

    Invariant (checked): `0 <= hit <= prompt`, `prompt >= 1`, `gen >= 1`, `starts` increasing
    from 0 to the number of rows; `arrival_s` (replay only) one non-negative time per row.
    """

    prompt_tokens: IntArray
    hit_tokens: IntArray
    gen_tokens: IntArray
    starts: IntArray
    arrival_s: FloatArray | None = None

    def __post_init__(self) -> None:
        n = len(self.prompt_tokens)
        o = "sim.workload"
        if len(self.hit_tokens) != n or len(self.gen_tokens) != n:
            raise SpecError(o, "hit_tokens", len(self.hit_tokens), f"need {n} rows like prompts")
        if len(self.starts) < 2 or int(self.starts[0]) != 0 or int(self.starts[-1]) != n:
            raise SpecError(o, "starts", len(self.starts), f"must run from 0 to {n}")
        if np.any(np.diff(self.starts) < 1):
            raise SpecError(o, "starts", "...", "every agent needs at least one turn")
        if n and (self.prompt_tokens.min() < 1 or self.gen_tokens.min() < 1):
            raise SpecError(o, "prompt_tokens", int(self.prompt_tokens.min()), "must be >= 1")
        bad = np.flatnonzero((self.hit_tokens < 0) | (self.hit_tokens > self.prompt_tokens))
        if len(bad):
            i = int(bad[0])
            raise SpecError(o, f"hit_tokens[{i}]", int(self.hit_tokens[i]),
                            f"must be in [0, {int(self.prompt_tokens[i])}]")
        if self.arrival_s is not None and (
            len(self.arrival_s) != n or (n and float(self.arrival_s.min()) < 0.0)
        ):
            raise SpecError(o, "arrival_s", len(self.arrival_s), f"need {n} times >= 0")

    @property
    def num_agents(self) -> int:
        return len(self.starts) - 1

    @property
    def num_turns(self) -> int:
        return len(self.prompt_tokens)

    @classmethod
    def from_turn_table(cls, table: TurnTable) -> Workload:
        """Trajectory turns with within-trajectory block-aligned hits (paper A.4)."""
        return cls(
            np.asarray(table.prompt_tokens, dtype=np.int64),
            np.asarray(table.hit_tokens, dtype=np.int64),
            np.asarray(table.gen_tokens, dtype=np.int64),
            np.asarray(table.starts, dtype=np.int64),
        )

    @classmethod
    def from_lists(
        cls, agents: Sequence[Sequence[tuple[int, int, int]]],
        arrival_s: Sequence[float] | None = None,
    ) -> Workload:
        """Agents as lists of `(prompt, hit, gen)` turns (tests, small hand-made runs)."""
        rows = [t for a in agents for t in a]
        arr = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        starts = np.zeros(len(agents) + 1, dtype=np.int64)
        np.cumsum([len(a) for a in agents], out=starts[1:])
        times = None if arrival_s is None else np.asarray(arrival_s, dtype=np.float64)
        return cls(arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy(), starts, times)

    @classmethod
    def from_mooncake(cls, trace: MooncakeTrace, block_size: int = 64) -> Workload:
        """A Mooncake trace for the `replay` driver: one single-turn agent per request at its
        timestamp, hits from its `hash_ids` (the trace's incremental prefix store). A hit
        covering the whole input is cut back one block: the last token is always computed."""
        prompt = np.asarray(trace.input_tokens, dtype=np.int64)
        hit = np.asarray(trace.hit_tokens, dtype=np.int64)
        if trace.block_size_tokens % block_size:
            raise SpecError("sim.workload", "block_size", block_size,
                            f"must divide the trace's {trace.block_size_tokens}-token blocks")
        full = hit >= prompt
        hit = np.where(full, ((prompt - 1) // block_size) * block_size, hit)
        n = len(prompt)
        return cls(prompt, hit, np.asarray(trace.output_tokens, dtype=np.int64),
                   np.arange(n + 1, dtype=np.int64),
                   np.asarray(trace.timestamp_s, dtype=np.float64))


def agent_workload(
    trace: str = "64k",
    num_agents: int = 64,
    *,
    seed: int = 0,
    max_len_tokens: int | None = None,
    append_factor: float = 1.0,
    gen_factor: float = 1.0,
    block_size: int = 64,
) -> Workload:
    """`num_agents` agents replaying the Table-2 synthetic trajectories of `trace` (32k, 48k,
    64k), optionally truncated at MAL `max_len_tokens` and with append/gen lengths scaled, with
    more agents than trajectories made by `workload.replay.expand_agents` (paper A.3)."""
    from dualpath.workload.replay import expand_agents, scale_lengths, truncate_at
    from dualpath.workload.synthetic import generate, preset

    trajs = generate(preset(trace), seed)
    if append_factor != 1.0 or gen_factor != 1.0:
        trajs = [scale_lengths(t, append_factor, gen_factor, max_len_tokens) for t in trajs]
    elif max_len_tokens is not None:
        trajs = [truncate_at(t, max_len_tokens) for t in trajs]
    agents = expand_agents(trajs, num_agents, seed)
    table = TurnTable.from_trajectories([a.trajectory for a in agents], block_size)
    return Workload.from_turn_table(table)
