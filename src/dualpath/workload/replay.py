"""The paper's replay rules (§7.3, A.3): MAL truncation, length scaling, more agents.

Truncation at MAL (Max Agent Length). Turns are kept in order while they fit: turn i is kept iff
its prompt plus at least one generated token fits, `context_i + A_i + 1 <= MAL`; its g_i is then
clipped to `MAL - context_i - A_i`, and every later turn is dropped. A first turn that does not fit
is clipped to `A_1 = MAL - 1, g_1 = 1` so every agent keeps at least one turn. Afterwards the
trajectory's total is at most MAL.

Scaling: every A_i (or g_i) is multiplied by a constant and rounded (at least 1), then the whole
trajectory is truncated at MAL, exactly as the paper's append/generation scaling experiments do.

Expansion: to run more agents than trajectories, agent k < len(trajectories) replays trajectory k;
every further agent samples a trajectory uniformly (seeded) and prepends a synthetic round of
random tokens (`A_1 = synthetic_append_tokens`, `g_1 = 1`) so its prefix, and therefore its blocks,
differ from every other agent's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dualpath.core.blocks import DEFAULT_BLOCK_SIZE
from dualpath.core.errors import SpecError
from dualpath.core.validate import non_negative_int, positive, positive_int
from dualpath.workload.trajectory import Trajectory


def truncate_at(trajectory: Trajectory, max_len_tokens: int) -> Trajectory:
    """`trajectory` cut at MAL `max_len_tokens` (>= 2) by the rule in the module docstring."""
    if isinstance(max_len_tokens, bool) or not isinstance(max_len_tokens, int) \
            or max_len_tokens < 2:
        raise SpecError("truncate_at", "max_len_tokens", max_len_tokens, "must be an integer >= 2")
    if trajectory.total_tokens <= max_len_tokens:
        return trajectory
    a = np.asarray(trajectory.append_tokens, dtype=np.int64)
    ctx = trajectory.context_tokens()
    fits = ctx + a + 1 <= max_len_tokens
    # Prompts grow strictly, so the turns that fit are a prefix: count them.
    n = int(np.argmin(fits)) if not fits.all() else len(a)
    if n == 0:
        return Trajectory((max_len_tokens - 1,), (1,), trajectory.trajectory_id)
    gen = list(trajectory.gen_tokens[:n])
    gen[-1] = min(gen[-1], max_len_tokens - int(ctx[n - 1]) - int(a[n - 1]))
    return Trajectory(trajectory.append_tokens[:n], tuple(gen), trajectory.trajectory_id)


def scale_lengths(
    trajectory: Trajectory, append_factor: float = 1.0, gen_factor: float = 1.0,
    max_len_tokens: int | None = None,
) -> Trajectory:
    """Every A_i times `append_factor` and g_i times `gen_factor` (rounded, >= 1), then MAL."""
    positive("scale_lengths", "append_factor", append_factor)
    positive("scale_lengths", "gen_factor", gen_factor)
    a = np.maximum(1, np.rint(np.asarray(trajectory.append_tokens) * append_factor))
    g = np.maximum(1, np.rint(np.asarray(trajectory.gen_tokens) * gen_factor))
    scaled = Trajectory.from_lengths(a.astype(np.int64), g.astype(np.int64),
                                     trajectory.trajectory_id)
    return scaled if max_len_tokens is None else truncate_at(scaled, max_len_tokens)


@dataclass(frozen=True, slots=True)
class Agent:
    """One replayed agent: its index, the trajectory it replays, and where that came from.

    `source_index` is the index of the original trajectory; `has_synthetic_round` says whether
    turn 0 is the prepended random round (its token ids are random, see `workload.tokens`).
    """

    agent_index: int
    trajectory: Trajectory
    source_index: int
    has_synthetic_round: bool = False


def expand_agents(
    trajectories: Sequence[Trajectory], num_agents: int, seed: int = 0,
    synthetic_append_tokens: int = DEFAULT_BLOCK_SIZE,
) -> list[Agent]:
    """`num_agents` agents: the trajectories themselves first, then sampled ones with a synthetic
    first round (see the module docstring). Deterministic given `seed`."""
    positive_int("expand_agents", "num_agents", num_agents)
    non_negative_int("expand_agents", "seed", seed)
    positive_int("expand_agents", "synthetic_append_tokens", synthetic_append_tokens)
    if not trajectories:
        raise SpecError("expand_agents", "trajectories", 0, "needs at least one trajectory")
    agents = [Agent(k, t, k) for k, t in enumerate(trajectories[:num_agents])]
    extra = num_agents - len(agents)
    if extra > 0:
        rng = np.random.default_rng(seed)
        picks = rng.integers(0, len(trajectories), size=extra)
        for j, src in enumerate(picks.tolist()):
            t = trajectories[src]
            k = len(trajectories) + j
            agents.append(Agent(
                k,
                Trajectory((synthetic_append_tokens, *t.append_tokens), (1, *t.gen_tokens),
                           f"{t.trajectory_id}+agent{k}"),
                src,
                has_synthetic_round=True,
            ))
    return agents
