"""One run of the emulated cluster (`RunConfig`: mode, cluster shape, NIC rates, buffers, engine
memory, policy overrides) and the scheduler parameters it implies.

Modes: the simulator's `dualpath.sched.mode.Mode` presets, by name, so every ablation step runs
here too: `basic` = PE read path only, no layerwise prefill, round-robin scheduling;
`layerwise` = basic with layerwise prefill; `dual-path` = layerwise with the shorter-read-queue
path choice; `dualpath` = that with the paper's scheduler; `split` = dualpath splitting each
read across both sides; `oracle` = dualpath with storage I/O and P-D transfers not paced (bytes
still move, so outputs are the same). (The runtime's PEs pack every forward pass under the
compute quota in every mode; the scheduler switch changes only inter-engine scheduling.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dualpath.core.errors import SpecError
from dualpath.core.validate import positive_int
from dualpath.runtime.kvlayout import KVLayout
from dualpath.runtime.model.model_source import ModelSource
from dualpath.runtime.node_context import check_budgets
from dualpath.sched.mode import MODE_PRESETS, Mode, mode_preset
from dualpath.sched.params import (
    PathMode,
    RRReadSide,
    SchedulerParams,
    TieSide,
    alpha_tokens_of,
)

MODES = tuple(MODE_PRESETS)
LAUNCHES = ("process", "thread")
# The emulated cluster runs on one machine: nodes are processes, engines threads. Past these
# a run would only thrash (or take minutes to start and leak its semaphores if killed).
MAX_NODES = 64
MAX_ENGINES_PER_NODE = 64
MAX_BLOCK_SIZE_TOKENS = 4096


@dataclass(frozen=True)
class RunConfig:
    """One run of the emulated cluster. Frozen, validated; units in the names."""

    mode: str
    """A `MODE_PRESETS` name (`switches` is its `Mode`)."""
    store_root: str
    model: ModelSource = field(default_factory=lambda: ModelSource("tiny"))
    num_prefill_nodes: int = 1
    num_decode_nodes: int = 2
    engines_per_node: int = 2
    storage_nic_bytes_per_s: float = 200 * 2**20
    compute_nic_bytes_per_s: float = 800 * 2**20
    buffer_bytes: int = 256 * 2**20
    hbm_bytes: int = 1 << 30
    block_size: int = 64
    transfer_kind: str = "auto"
    launch: str = "process"
    temperature: float = 0.0
    seed: int = 0
    path_mode: str | None = None
    """Override the mode's read-path policy: pe, dual, split, or de (everything on the DE
    side; for tests of the DE path)."""
    alpha_tokens: float | None = None
    """Default: 3 s of one storage NIC's reads (paper A.4)."""
    beta_tokens: float = 1e9
    """Default: no engine is ever "overloaded" (the runtime's engines queue work themselves)."""
    fetch_interval_s: float = 0.005
    read_tie_side: str | None = None
    """Where the dual-path rule reads when both read queues are equal: pe, de, or balanced
    (`SchedulerParams.dual_tie_side`); None: the scheduler's default (balanced)."""
    rr_read_side: str | None = None
    """How the round-robin modes pick the read side: queue (the shorter read queue) or random
    (a coin seeded with `seed`; `SchedulerParams.rr_read_side`); None: the scheduler's default
    (random)."""
    is_cache_enabled: bool = True
    """False: every prompt is fully recomputed (no storage reads); blocks are still persisted."""
    compute_quota_s: float = 0.3
    """PE forward-pass quota of estimated attention time (paper A.4: 300 ms)."""
    max_batch_tokens: int | None = None
    """Optional cap on the new tokens of one PE forward pass (None: the quota alone)."""
    stats_interval_s: float | None = None
    """Nodes report their counters this often (`Cluster.live_stats`); None: at shutdown."""
    estimator: str = "measured"
    """PE pass-time estimator: measured (each prefill node times its model at start-up) or
    cost-model (deterministic; `runtime.estimator`)."""

    def __post_init__(self) -> None:
        owner = "run"
        if self.mode not in MODES:
            raise SpecError(owner, "mode", self.mode, f"must be one of {', '.join(MODES)}")
        if self.launch not in LAUNCHES:
            raise SpecError(owner, "launch", self.launch, f"must be one of {', '.join(LAUNCHES)}")
        for name, kind in (("read_tie_side", TieSide), ("rr_read_side", RRReadSide)):
            if getattr(self, name) not in {None, *(k.value for k in kind)}:
                raise SpecError(owner, name, getattr(self, name),
                                f"must be one of {', '.join(k.value for k in kind)}")
        if self.path_mode not in (None, "pe", "dual", "split", "de"):
            raise SpecError(owner, "path_mode", self.path_mode, "must be pe, dual, split or de")
        for name in ("num_prefill_nodes", "num_decode_nodes", "engines_per_node", "block_size"):
            positive_int(owner, name, getattr(self, name))
        check_budgets(owner, self)
        for name, value, limit in (
            ("num_prefill_nodes + num_decode_nodes", self.num_nodes, MAX_NODES),
            ("engines_per_node", self.engines_per_node, MAX_ENGINES_PER_NODE),
            ("block_size", self.block_size, MAX_BLOCK_SIZE_TOKENS),
        ):
            if value > limit:
                raise SpecError(owner, name, value, f"at most {limit} on this one-machine "
                                "emulated cluster")

    @property
    def switches(self) -> Mode:
        """The mode's switches (the same `Mode` the simulator runs)."""
        return mode_preset(self.mode)

    @property
    def is_layerwise(self) -> bool:
        return self.switches.is_layerwise

    @property
    def is_oracle(self) -> bool:
        return self.switches.is_oracle

    @property
    def num_nodes(self) -> int:
        return self.num_prefill_nodes + self.num_decode_nodes

    @property
    def memory_bytes(self) -> int:
        """What the cluster holds in this machine's memory besides the models: every node's
        DRAM buffer and every decode engine's KV memory (both touched as they are used)."""
        return (self.num_nodes * self.buffer_bytes
                + self.num_decode_nodes * self.engines_per_node * self.hbm_bytes)


def scheduler_params(cfg: RunConfig, layout: KVLayout) -> SchedulerParams:
    """The paper's parameters for this run (alpha: 3 s of storage-NIC reads)."""
    alpha = cfg.alpha_tokens
    if alpha is None:
        alpha = alpha_tokens_of(cfg.storage_nic_bytes_per_s, layout.kv_bytes_per_token)
        if cfg.is_oracle or alpha == float("inf"):
            alpha = 1e12
    mode = cfg.path_mode or cfg.switches.paths
    return SchedulerParams(
        alpha_tokens=alpha,
        beta_tokens=cfg.beta_tokens,
        kv_bytes_per_token=layout.kv_bytes_per_token,
        block_size_tokens=cfg.block_size,
        path_mode=PathMode.PE if mode in ("pe", "de") else PathMode(mode),
    ).with_overrides(**{name: value for name, value in (
        ("dual_tie_side", cfg.read_tie_side), ("rr_read_side", cfg.rr_read_side))
        if value is not None})
