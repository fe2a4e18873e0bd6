"""Synthetic agent trajectories matching the paper's Table 2 (MaxLen 32K, 48K, 64K).

Model (all draws from `numpy.random.Generator`s seeded by `seed`; `LN(m, s)` is a lognormal
with *mean* m and log-space standard deviation s, i.e. exp(N(log m - s^2/2, s^2))):

- natural turn count   T_k ~ round(LN(natural_turns_mean, natural_turns_sigma)), >= 1: the turns
                         the agent would take if its context were unlimited;
- first append         A_k1 ~ LN(first_append_mean_tokens, first_append_sigma): the task prompt
                         (system prompt, tool schemas, issue text, repository summary);
- later appends        A_ki = a_k * LN(1, append_turn_sigma), a_k ~ LN(append_mean_tokens,
                         append_trajectory_sigma): tool output; per-turn sigma around 1 makes it
                         heavy-tailed (most outputs are short, a few are very long), and the
                         per-trajectory level a_k makes some agents verbose throughout;
- generations          g_ki = b_k * LN(1, gen_turn_sigma), b_k ~ LN(gen_mean_tokens,
                         gen_trajectory_sigma): the next tool call;
- every length is rounded and at least 1; then the trajectory is truncated at MaxLen by the
  replay rule (`workload.replay.truncate_at`), which is why Total sits below MaxLen and why
  trajectories with long appends have fewer turns (Append, a per-trajectory mean, exceeds the
  pooled mean).

The presets' parameters were fitted with `workload.fit.fit_params` (seed 0) so that Turns, Append,
Gen, Total, Context (Table 2 semantics, see `workload.stats`) and the hit rate 1 - Append/Context
each land within 2% of the paper; tests check 5% over several seeds.

Generation is vectorized: the turns are drawn in fixed blocks of columns for every trajectory, so
500 x ~160 turns take a few milliseconds, and the random stream does not depend on the parameters
(which makes fitting smooth).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import numpy.typing as npt

from dualpath.core.blocks import DEFAULT_BLOCK_SIZE
from dualpath.core.errors import SpecError, UnknownPresetError
from dualpath.core.validate import non_negative, positive, positive_int
from dualpath.workload.trajectory import Trajectory, TurnTable

_BLOCK_COLUMNS = 128
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Table2Row:
    """One row of the paper's Table 2: the averages a generated set should reproduce."""

    max_len_tokens: int
    turns: float
    append_tokens: float
    gen_tokens: float
    total_tokens: float
    context_tokens: float

    @property
    def hit_rate(self) -> float:
        """The paper's implied hit rate, 1 - Append/Context (98.7% for the 64K row)."""
        return 1.0 - self.append_tokens / self.context_tokens


# Paper Table 2 (500 trajectories each).
TABLE2: dict[str, Table2Row] = {
    "32k": Table2Row(32768, 60, 608, 148, 28639, 17183),
    "48k": Table2Row(49152, 106, 474, 172, 42607, 25120),
    "64k": Table2Row(65536, 157, 429, 176, 55958, 32721),
}


@dataclass(frozen=True, slots=True)
class SyntheticParams:
    """Distribution parameters of the synthetic generator (see the module docstring)."""

    max_len_tokens: int
    natural_turns_mean: float
    natural_turns_sigma: float
    first_append_mean_tokens: float
    first_append_sigma: float
    append_mean_tokens: float
    append_trajectory_sigma: float
    append_turn_sigma: float
    gen_mean_tokens: float
    gen_trajectory_sigma: float
    gen_turn_sigma: float
    num_trajectories: int = 500

    def __post_init__(self) -> None:
        owner = "SyntheticParams"
        positive_int(owner, "max_len_tokens", self.max_len_tokens)
        if self.max_len_tokens < 2:
            raise SpecError(owner, "max_len_tokens", self.max_len_tokens,
                            "must be >= 2 (room for one appended and one generated token)")
        positive_int(owner, "num_trajectories", self.num_trajectories)
        for name in ("natural_turns_mean", "first_append_mean_tokens", "append_mean_tokens",
                     "gen_mean_tokens"):
            positive(owner, name, getattr(self, name))
        for name in ("natural_turns_sigma", "first_append_sigma", "append_trajectory_sigma",
                     "append_turn_sigma", "gen_trajectory_sigma", "gen_turn_sigma"):
            non_negative(owner, name, getattr(self, name))

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def with_num_trajectories(self, num_trajectories: int) -> SyntheticParams:
        d = self.to_dict()
        d["num_trajectories"] = num_trajectories
        return SyntheticParams(**d)  # type: ignore[arg-type]


# Fitted with workload.fit.fit_params(TABLE2[name], seed=0); see the module docstring.
PRESETS: dict[str, SyntheticParams] = {
    "32k": SyntheticParams(32768, 70.0, 0.6, 5000.0, 0.3, 500.0, 0.4, 1.0, 150.0, 0.3, 0.6),
    "48k": SyntheticParams(49152, 120.0, 0.6, 7000.0, 0.3, 400.0, 0.4, 1.0, 170.0, 0.3, 0.6),
    "64k": SyntheticParams(65536, 180.0, 0.6, 9000.0, 0.3, 350.0, 0.4, 1.0, 175.0, 0.3, 0.6),
}


def preset(name: str) -> SyntheticParams:
    """The fitted parameters of preset `name` (32k, 48k, 64k)."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise UnknownPresetError("workload", name, list(PRESETS)) from None


def _lognormal(z: FloatArray, mean: float | FloatArray, sigma: float) -> FloatArray:
    """LN(mean, sigma) from standard normals z (mean-preserving)."""
    return np.asarray(mean * np.exp(sigma * z - 0.5 * sigma * sigma), dtype=np.float64)


def generate_table(
    params: SyntheticParams, seed: int = 0, block_size: int = DEFAULT_BLOCK_SIZE
) -> TurnTable:
    """`params.num_trajectories` trajectories as a `TurnTable`, deterministic given `seed`."""
    n, mal = params.num_trajectories, params.max_len_tokens
    base = np.random.SeedSequence(seed)
    per_traj = np.random.default_rng(base.spawn(1)[0]).standard_normal((4, n))
    natural = np.maximum(
        1, np.rint(_lognormal(per_traj[0], params.natural_turns_mean, params.natural_turns_sigma))
    ).astype(np.int64)
    first = _lognormal(per_traj[1], params.first_append_mean_tokens, params.first_append_sigma)
    level_a = _lognormal(per_traj[2], params.append_mean_tokens, params.append_trajectory_sigma)
    level_g = _lognormal(per_traj[3], params.gen_mean_tokens, params.gen_trajectory_sigma)

    # Draw blocks of turn columns until every trajectory has ended naturally or passed MaxLen.
    # Block b always comes from the same child seed, whatever the parameters.
    a_blocks: list[FloatArray] = []
    g_blocks: list[FloatArray] = []
    length = np.zeros(n, dtype=np.float64)
    b = 0
    while True:
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(1 + b,)))
        z = rng.standard_normal((2, n, _BLOCK_COLUMNS))
        a = np.maximum(1, np.rint(_lognormal(z[0], level_a[:, None], params.append_turn_sigma)))
        if b == 0:
            a[:, 0] = np.maximum(1, np.rint(first))
        g = np.maximum(1, np.rint(_lognormal(z[1], level_g[:, None], params.gen_turn_sigma)))
        a_blocks.append(a)
        g_blocks.append(g)
        length += (a + g).sum(axis=1)
        b += 1
        if np.all((length > mal) | (natural <= b * _BLOCK_COLUMNS)):
            break
    a_all = np.concatenate(a_blocks, axis=1).astype(np.int64)
    g_all = np.concatenate(g_blocks, axis=1).astype(np.int64)
    return _truncated_table(a_all, g_all, natural, mal, block_size)


def _truncated_table(
    a: npt.NDArray[np.int64], g: npt.NDArray[np.int64], natural: npt.NDArray[np.int64],
    mal: int, block_size: int,
) -> TurnTable:
    """Apply the natural end and `replay.truncate_at(mal)` to every row at once."""
    n, width = a.shape
    step = a + g
    ctx = np.cumsum(step, axis=1) - step
    cols = np.arange(width)[None, :]
    keep = np.logical_and.accumulate((cols < natural[:, None]) & (ctx + a + 1 <= mal), axis=1)
    # A first turn that does not fit is clipped to (MAL - 1, 1), as truncate_at does.
    no_turn = ~keep[:, 0]
    a[no_turn, 0] = mal - 1
    g[no_turn, 0] = 1
    keep[no_turn, 0] = True
    counts = keep.sum(axis=1)
    last = counts - 1
    rows = np.arange(n)
    g[rows, last] = np.minimum(g[rows, last], mal - ctx[rows, last] - a[rows, last])
    g[no_turn, 0] = 1
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    traj = np.repeat(np.arange(n, dtype=np.int64), counts)
    turn = np.arange(int(starts[-1]), dtype=np.int64) - np.repeat(starts[:-1], counts)
    return TurnTable.from_arrays(traj, turn, a[keep], g[keep], starts, block_size)


def generate(params: SyntheticParams, seed: int = 0, id_prefix: str = "") -> list[Trajectory]:
    """`params.num_trajectories` trajectories with ids `<id_prefix><k>`, deterministic in `seed`."""
    table = generate_table(params, seed)
    return [table.trajectory(k, f"{id_prefix}{k}") for k in range(table.num_trajectories)]
