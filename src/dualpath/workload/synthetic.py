"""Synthetic agent trajectories matching the paper's Table 2 (MaxLen 32K, 48K, 64K).

Model, per trajectory k and 0-based turn i (`LN(m, s)` is a lognormal with *mean* m and
log-space standard deviation s, i.e. exp(N(log m - s^2/2, s^2))):

- natural length  L_k ~ LN(natural_total_mean_tokens, natural_total_sigma): the work the agent
                  does before finishing on its own; turn i runs iff its context is below L_k
                  (turn 0 always runs). corr(log L_k, log a_k) = -natural_total_append_correlation:
                  terse agents run longer.
- task prompt     A_k0 ~ LN(first_append_mean_tokens, first_append_sigma) (system prompt, tools,
                  issue text).
- tool outputs    A_ki = a_k * LN(1, append_turn_sigma) * (1 + i)^-append_decay_exponent for
                  i >= 1, a_k ~ LN(append_mean_tokens, append_trajectory_sigma). The
                  per-agent level a_k spans an order of magnitude and each turn varies around
                  it, so the pooled append distribution is heavy-tailed (a lognormal mixture,
                  log-sd about 1.2: most outputs are short, a few are tens of times longer);
                  the decay front-loads exploration (reading files early, short edits later).
- tool calls      g_ki = b_k * LN(1, gen_turn_sigma), b_k ~ LN(gen_mean_tokens,
                  gen_trajectory_sigma).
- Every length is rounded and at least 1; then the trajectory is truncated at MaxLen by the replay
  rule (`workload.replay.truncate_at`). That is why Total sits below MaxLen and why agents with
  long appends have fewer turns (Append, a per-trajectory mean, exceeds the pooled mean).

Randomness: `numpy.random.Generator`s seeded from `seed` only. The per-agent draws (L_k, A_k0,
a_k, b_k) are Latin-hypercube stratified normals within +-2 sigma, so every seed's 500 agents
cover the distribution evenly; per-turn draws come in fixed blocks of columns whose stream does
not depend on the parameters (which makes fitting deterministic and smooth).

The presets were fitted by `workload.fit.fit_params(TABLE2[name])` (seeds 0, 1, 2): Turns,
Append, Gen, Total and Context (Table 2 semantics, see `workload.stats`) land within about 2% of
the paper on seeds 0-2 and within 4% on seeds 0-7; tests check 5%. 500 x ~160 turns take a few
tens of milliseconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

from dualpath.core.blocks import DEFAULT_BLOCK_SIZE
from dualpath.core.errors import SpecError, UnknownPresetError
from dualpath.core.validate import non_negative, non_negative_int, positive, positive_int
from dualpath.workload.trajectory import Trajectory, TurnTable

_BLOCK_COLUMNS = 128
_TAIL_QUANTILE = NormalDist().cdf(-2.0)
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
    natural_total_mean_tokens: float
    natural_total_sigma: float
    first_append_mean_tokens: float
    first_append_sigma: float
    append_mean_tokens: float
    append_trajectory_sigma: float
    append_turn_sigma: float
    gen_mean_tokens: float
    gen_trajectory_sigma: float
    gen_turn_sigma: float
    natural_total_append_correlation: float = 0.0
    append_decay_exponent: float = 0.0
    num_trajectories: int = 500

    def __post_init__(self) -> None:
        owner = "SyntheticParams"
        positive_int(owner, "max_len_tokens", self.max_len_tokens)
        if self.max_len_tokens < 2:
            raise SpecError(owner, "max_len_tokens", self.max_len_tokens,
                            "must be >= 2 (room for one appended and one generated token)")
        positive_int(owner, "num_trajectories", self.num_trajectories)
        for name in ("natural_total_mean_tokens", "first_append_mean_tokens", "append_mean_tokens",
                     "gen_mean_tokens"):
            positive(owner, name, getattr(self, name))
        for name in ("natural_total_sigma", "first_append_sigma", "append_trajectory_sigma",
                     "append_turn_sigma", "gen_trajectory_sigma", "gen_turn_sigma",
                     "append_decay_exponent"):
            non_negative(owner, name, getattr(self, name))
        rho = self.natural_total_append_correlation
        if isinstance(rho, bool) or not isinstance(rho, int | float) or not -1 <= rho <= 1:
            raise SpecError(owner, "natural_total_append_correlation", rho, "must be in [-1, 1]")

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def with_num_trajectories(self, num_trajectories: int) -> SyntheticParams:
        d = self.to_dict()
        d["num_trajectories"] = num_trajectories
        return SyntheticParams(**d)  # type: ignore[arg-type]


# Fitted by workload.fit.fit_params(TABLE2[name]) and rounded; see the module docstring.
PRESETS: dict[str, SyntheticParams] = {
    "32k": SyntheticParams(
        max_len_tokens=32768, natural_total_mean_tokens=29427.0, natural_total_sigma=0.2134,
        first_append_mean_tokens=2600.0, first_append_sigma=0.3, append_mean_tokens=1242.0,
        append_trajectory_sigma=0.8069, append_turn_sigma=0.6, gen_mean_tokens=149.8,
        gen_trajectory_sigma=0.3, gen_turn_sigma=0.6, natural_total_append_correlation=0.7266,
        append_decay_exponent=0.3026,
    ),
    "48k": SyntheticParams(
        max_len_tokens=49152, natural_total_mean_tokens=50584.0, natural_total_sigma=0.3812,
        first_append_mean_tokens=2669.0, first_append_sigma=0.3, append_mean_tokens=1188.0,
        append_trajectory_sigma=0.9939, append_turn_sigma=0.6, gen_mean_tokens=173.4,
        gen_trajectory_sigma=0.3, gen_turn_sigma=0.6, natural_total_append_correlation=0.2634,
        append_decay_exponent=0.3084,
    ),
    "64k": SyntheticParams(
        max_len_tokens=65536, natural_total_mean_tokens=125227.0, natural_total_sigma=0.8938,
        first_append_mean_tokens=242.4, first_append_sigma=0.3, append_mean_tokens=941.4,
        append_trajectory_sigma=1.0032, append_turn_sigma=0.6, gen_mean_tokens=177.4,
        gen_trajectory_sigma=0.3, gen_turn_sigma=0.6, natural_total_append_correlation=0.9090,
        append_decay_exponent=0.2197,
    ),
}


def preset(name: str) -> SyntheticParams:
    """The fitted parameters of preset `name` (32k, 48k, 64k)."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise UnknownPresetError("workload", name, list(PRESETS)) from None


def _stratified_normals(rng: np.random.Generator, dims: int, n: int) -> FloatArray:
    """`dims` x `n` standard normals by Latin hypercube sampling: each row holds one draw from
    each of n equiprobable strata, in random order. Per-trajectory levels are strongly dispersed
    (Append averages over agents with very different verbosity); stratifying keeps every seed's
    set of 500 close to the fitted averages instead of a few percent off by chance. Draws are
    confined to +-2 standard deviations."""
    inv_cdf = NormalDist().inv_cdf
    u = (np.argsort(rng.random((dims, n)), axis=1) + rng.random((dims, n))) / n
    # Levels beyond +-2 sigma are left out: a handful of extreme agents (a 15x-verbose one runs 3
    # turns) would otherwise swing the per-trajectory means by several percent between seeds.
    u = _TAIL_QUANTILE + (1 - 2 * _TAIL_QUANTILE) * u
    return np.asarray(np.vectorize(inv_cdf, otypes=[np.float64])(u), dtype=np.float64)


def _lognormal(z: FloatArray, mean: float | FloatArray, sigma: float) -> FloatArray:
    """LN(mean, sigma) from standard normals z (mean-preserving)."""
    return np.asarray(mean * np.exp(sigma * z - 0.5 * sigma * sigma), dtype=np.float64)


def generate_table(
    params: SyntheticParams, seed: int = 0, block_size: int = DEFAULT_BLOCK_SIZE
) -> TurnTable:
    """`params.num_trajectories` trajectories as a `TurnTable`, deterministic given `seed`."""
    non_negative_int("generate", "seed", seed)
    n, mal = params.num_trajectories, params.max_len_tokens
    base = np.random.SeedSequence(seed)
    per_traj = _stratified_normals(np.random.default_rng(base.spawn(1)[0]), 4, n)
    # Agents that append little per turn tend to run long: corr(log L_k, log a_k) = -rho.
    rho = params.natural_total_append_correlation
    z_natural = -rho * per_traj[2] + np.sqrt(1 - rho * rho) * per_traj[0]
    natural = _lognormal(z_natural, params.natural_total_mean_tokens, params.natural_total_sigma)
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
        decay = (1.0 + np.arange(b * _BLOCK_COLUMNS, (b + 1) * _BLOCK_COLUMNS)) ** (
            -params.append_decay_exponent)
        a = np.maximum(1, np.rint(
            _lognormal(z[0], level_a[:, None], params.append_turn_sigma) * decay[None, :]))
        if b == 0:
            a[:, 0] = np.maximum(1, np.rint(first))
        g = np.maximum(1, np.rint(_lognormal(z[1], level_g[:, None], params.gen_turn_sigma)))
        a_blocks.append(a)
        g_blocks.append(g)
        length += (a + g).sum(axis=1)
        b += 1
        if np.all(length >= np.minimum(natural, mal)):
            break
    a_all = np.concatenate(a_blocks, axis=1).astype(np.int64)
    g_all = np.concatenate(g_blocks, axis=1).astype(np.int64)
    return _truncated_table(a_all, g_all, natural, mal, block_size)


def _truncated_table(
    a: npt.NDArray[np.int64], g: npt.NDArray[np.int64], natural: FloatArray,
    mal: int, block_size: int,
) -> TurnTable:
    """Apply the natural end and `replay.truncate_at(mal)` to every row at once."""
    n = a.shape[0]
    step = a + g
    ctx = np.cumsum(step, axis=1) - step
    keep = np.logical_and.accumulate((ctx < natural[:, None]) & (ctx + a + 1 <= mal), axis=1)
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
