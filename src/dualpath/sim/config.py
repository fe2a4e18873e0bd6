"""Frozen, validated configuration of one simulation: cluster, mode switches, scheduler and
physical parameters, workload and driver, seed. Composed at the top; never mutated at run time."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from dualpath.core.cluster import ClusterSpec
from dualpath.core.errors import SpecError
from dualpath.core.read_rate import StorageReadModel
from dualpath.core.validate import non_negative, non_negative_int, positive, positive_int
from dualpath.sched.mode import MODE_PRESETS, Mode, mode_preset
from dualpath.sched.params import SchedulerParams
from dualpath.sched.profiled import ProfiledCosts
from dualpath.sim.workload import Workload

DRIVERS = ("offline", "online", "replay")
DECODE_CAP_AT = ("assign", "decode")
"""Where the decode sequence cap applies (`SimParams.decode_cap_at`)."""

READ_DISCIPLINES = ("fifo", "shared")

# `Mode` is shared with the runtime (`dualpath.sched.mode`); re-exported for existing imports.
__all__ = ["DRIVERS", "FIFO", "MODE_PRESETS", "READ_DISCIPLINES", "Driver", "Mode",
           "ReadDiscipline", "SimConfig", "SimParams", "mode_preset"]


@dataclass(frozen=True)
class ReadDiscipline:
    """How a node's storage NIC serves the requests whose hit KV it reads: a property of the
    engine's reader, not of the NIC.

    `fifo`: one request's read at a time, at the NIC's whole rate, in queue order (the paper's
    read queue; an engine that hands a request's blocks to a shared pool of reader threads in
    arrival order, so its blocks are all queued before the next request's). `shared`: up to
    `max_in_flight` requests' reads at once, the NIC's rate divided among them (processor
    sharing: an engine that reads each of several requests one block at a time on a thread of
    its own, so their blocks take turns on the NIC)."""

    kind: str = "fifo"
    max_in_flight: int = 0
    """`shared`: requests read at once per node (0: no bound); `fifo` takes none."""

    def __post_init__(self) -> None:
        o = "sim.params.read_discipline"
        if self.kind not in READ_DISCIPLINES:
            raise SpecError(o, "kind", self.kind, f"must be one of {', '.join(READ_DISCIPLINES)}")
        non_negative_int(o, "max_in_flight", self.max_in_flight)
        if self.kind == "fifo" and self.max_in_flight not in (0, 1):
            raise SpecError(o, "max_in_flight", self.max_in_flight,
                            "fifo reads one request at a time (0 or 1)")

    @classmethod
    def parse(cls, text: str) -> ReadDiscipline:
        """`fifo`, `shared` (no bound) or `shared:N` (N requests at once)."""
        kind, sep, num = text.partition(":")
        if sep and not num.isdigit():
            raise SpecError("sim.params.read_discipline", "max_in_flight", num,
                            "must be a whole number (shared:N)")
        return cls(kind, int(num) if sep else 0)

    @property
    def num_slots(self) -> int:
        """Requests a node reads at once: 1 for `fifo`; 0 means no bound."""
        return 1 if self.kind == "fifo" else self.max_in_flight

    def describe(self) -> str:
        if self.kind == "fifo":
            return "fifo"
        return f"shared ({self.max_in_flight or 'any number of'} requests at once)"


FIFO = ReadDiscipline()
"""The paper's read queue (the default)."""


@dataclass(frozen=True)
class SimParams:
    """Scheduler constants and physical details the specs do not carry."""

    block_size_tokens: int = 64
    max_batch_tokens: int = 16384
    """Round-robin (no quota) forward batch limit in new tokens per engine."""
    inference_load_fraction: float = 0.0
    """High-priority (inference) traffic share of a compute NIC while its engine runs a forward
    pass; KV traffic gets the rest but never less than `kv_min_share`."""
    kv_min_share: float = 0.01
    """The low-priority class's guaranteed share when both are backlogged (99:1 arbitration)."""
    hbm_reserve_fraction: float | None = None
    """HBM held back for activations and workspace, beyond the model weights. None: the cost
    coefficients' fitted value (`CostCoefficients.hbm_reserve_fraction`)."""
    storage_cluster_bytes_per_s: float = 0.0
    """Aggregate read cap of the storage cluster (0: none; each storage NIC is its own cap)."""
    storage_read: StorageReadModel | None = None
    """The storage NICs' effective KV read rate. None: the hardware preset's calibrated record
    (`dualpath.core.read_rate.storage_read_model`); `NOMINAL` reads at the line rate."""
    is_group_synchronized: bool | None = None
    """Synchronize each node's engines per forward step (EP group). None: iff the model is MoE."""
    utilization_bin_s: float = 10.0
    """Width of the bins of the per-resource utilization time series."""
    prefill_ep_engines: int = 0
    """Engines one expert-parallel group spans on the prefill side: a MoE model's weights are
    sharded over them, which sets the weight bytes each engine holds (and so its HBM left for
    KV). 0: every prefill engine of the cluster."""
    decode_ep_engines: int = 0
    """The same on the decode side, where the shard is also read once per decode step. 0: every
    decode engine of the cluster (a cluster scaled out as copies of a small unit keeps the
    unit's count instead)."""

    pe_reads: ReadDiscipline = FIFO
    """How the prefill nodes' storage NICs serve their requests' reads (PE-side reads)."""
    de_reads: ReadDiscipline = FIFO
    """How the decode nodes' storage NICs serve their requests' reads (DE-side reads)."""

    is_next_turn_after_persist: bool = False
    """An agent's next turn arrives only once the finished turn's new Full Blocks are in
    storage (the runtime reports a turn done after persisting it), not when its last token is
    out."""

    turn_dispatch_s: float = 0.0
    """Control-plane latency on a turn's way in: from its arrival until the scheduler has it
    (in a real deployment: the client -> router / scheduler -> engine hops, the fetches that
    hand it to both engines). Counted in its TTFT and JCT; 0: none (the paper's model). A
    profile measures it (`run.control_plane`)."""
    turn_return_s: float = 0.0
    """Control-plane latency on a turn's way out: from its end (its last token, or its
    persistence with `is_next_turn_after_persist`) until the agent's next turn arrives (the
    completion's hops back to the client, which submits the next turn). 0: none."""
    decode_slot_hold_s: float = 0.0
    """Least time a turn holds its decode engine's seat (under
    `SchedulerParams.max_seqs_per_decode_engine`), its HBM and its load charge, counted from
    its DE assignment: they are given back at max(its last token, assignment + this). Models a
    per-turn DE occupancy the simulator does not otherwise have (a serving engine's setup or
    teardown per sequence, or the paper's DE-first wait through the PE queue, read and prefill
    when that is longer than ours). Not from the paper: an opt-in probe of Fig. 9's generation
    trend (the reproduction report's Fig. 9 addendum). 0: none (given back at the last
    token)."""
    read_streams_per_request: int = 0
    """Full Block reads one request keeps in flight on its storage NIC (0: no bound, a read
    takes whatever share of the NIC it gets). With N > 0 each request's read is also capped at
    N x S / (L + S / r), one stream's rate for Full Blocks of S bytes from the storage model's
    per-read latency `L` and stream rate `r` (`core.read_rate`'s published 3FS figures unless the
    model says otherwise), so at light load a turn's read takes its latency, not its bytes over
    the NIC's rate; the NIC's own rate still caps the node's reads together. Needs the `shared`
    read discipline on both sides (a `fifo` node reads one request at a time, which a capped
    request would leave mostly idle). Not from the paper: an opt-in probe of why the paper's
    DualPath is slower than ours where storage is not saturated; no single N serves the
    paper's three models (the reproduction report's storage section)."""
    decode_cap_at: str = "assign"
    """Where the decode sequence cap (`CostCoefficients.max_seqs_per_decode_engine`) holds a
    turn back. `assign`: the DE scheduler counts it beside HBM when it gives the turn its decode
    engine, before its read and prefill (a turn waits in the global queue). `decode`: the
    scheduler checks HBM only (the paper's §6.1) and the cap counts the turns each decode engine
    has admitted to decode (copy-in and decoding); a prefilled turn waits in its DE buffer for a
    place, as a serving engine's running-request limit (vLLM `max_num_seqs`) holds a request in
    its waiting queue. An opt-in probe: it leaves the prefill engines as starved in Fig. 14 as
    `assign` does (the run stays decode-bound) and steepens Fig. 9's generation trend (the
    reproduction report's Fig. 12 and Fig. 9 addenda)."""

    def __post_init__(self) -> None:
        o = "sim.params"
        if self.decode_cap_at not in DECODE_CAP_AT:
            raise SpecError(o, "decode_cap_at", self.decode_cap_at,
                            f"must be one of {', '.join(DECODE_CAP_AT)}")
        positive_int(o, "block_size_tokens", self.block_size_tokens)
        positive_int(o, "max_batch_tokens", self.max_batch_tokens)
        non_negative(o, "inference_load_fraction", self.inference_load_fraction)
        if self.inference_load_fraction > 1.0:
            raise SpecError(o, "inference_load_fraction", self.inference_load_fraction,
                            "must be <= 1")
        positive(o, "kv_min_share", self.kv_min_share)
        if self.hbm_reserve_fraction is not None:
            non_negative(o, "hbm_reserve_fraction", self.hbm_reserve_fraction)
            if self.hbm_reserve_fraction >= 1.0:
                raise SpecError(o, "hbm_reserve_fraction", self.hbm_reserve_fraction,
                                "must be < 1")
        non_negative(o, "storage_cluster_bytes_per_s", self.storage_cluster_bytes_per_s)
        positive(o, "utilization_bin_s", self.utilization_bin_s)
        non_negative_int(o, "prefill_ep_engines", self.prefill_ep_engines)
        non_negative_int(o, "decode_ep_engines", self.decode_ep_engines)
        non_negative(o, "turn_dispatch_s", self.turn_dispatch_s)
        non_negative(o, "turn_return_s", self.turn_return_s)
        non_negative(o, "decode_slot_hold_s", self.decode_slot_hold_s)
        non_negative_int(o, "read_streams_per_request", self.read_streams_per_request)
        if self.read_streams_per_request and "fifo" in (self.pe_reads.kind, self.de_reads.kind):
            raise SpecError(o, "read_streams_per_request", self.read_streams_per_request,
                            "needs the shared read discipline on both sides (pe_reads, "
                            "de_reads): a fifo node reads one request at a time")


@dataclass(frozen=True)
class Driver:
    """How turns arrive. `offline`: `num_agents` agents start at t = 0, JCT when all finish.
    `online`: Poisson agent arrivals at `agents_per_s`, each replaying its trajectory back to
    back, until `max_duration_s` or the paper's stop rule. `replay`: a Mooncake-format trace by
    its timestamps."""

    kind: str = "offline"
    num_agents: int = 64
    """Offline: agents started at t = 0. Online: agents that arrive (0: no limit)."""
    agents_per_s: float = 0.0
    max_duration_s: float = 3600.0
    ttft_limit_s: float = 4.0
    """Online stop rule (1): stop when a turn's TTFT exceeds this (0: never)."""
    steady_window_s: float = 150.0
    steady_lookback_s: float = 1800.0
    steady_tolerance: float = 0.05
    """Online stop rule (2): mean TTFT over the last window within this of the window
    `steady_lookback_s` earlier."""

    def __post_init__(self) -> None:
        o = "sim.driver"
        if self.kind not in DRIVERS:
            raise SpecError(o, "kind", self.kind, f"must be one of {', '.join(DRIVERS)}")
        non_negative_int(o, "num_agents", self.num_agents)
        non_negative(o, "agents_per_s", self.agents_per_s)
        if self.kind == "online" and self.agents_per_s <= 0:
            raise SpecError(o, "agents_per_s", self.agents_per_s, "must be > 0 for online")
        positive(o, "max_duration_s", self.max_duration_s)
        non_negative(o, "ttft_limit_s", self.ttft_limit_s)
        positive(o, "steady_window_s", self.steady_window_s)
        positive(o, "steady_lookback_s", self.steady_lookback_s)
        positive(o, "steady_tolerance", self.steady_tolerance)


@dataclass(frozen=True)
class SimConfig:
    """Everything one run needs. Offline runs replay the first `driver.num_agents` agents of
    `workload` (cycling if it has fewer), online runs take agents in order as they arrive, replay
    runs every turn at its `arrival_s`."""

    cluster: ClusterSpec
    workload: Workload
    mode: Mode = field(default_factory=Mode)
    driver: Driver = field(default_factory=Driver)
    params: SimParams = field(default_factory=SimParams)
    scheduler: SchedulerParams | None = None
    """Policy constants (alpha, beta, Z, compute quota, [INF] choices); None derives the paper's
    defaults for this model and hardware (`derive_scheduler_params`). The read-path mode and
    block size always come from `mode` and `params`."""
    scheduler_overrides: tuple[tuple[str, str], ...] = ()
    """`SchedulerParams` fields by name and value, over `scheduler` (or the derived defaults),
    e.g. `(("dual_tie_side", "balanced"), ("rr_read_side", "random"))`."""
    seed: int = 0
    """Online arrivals' and the scheduler's read-side coin's (`rr_read_side` `random`) seed."""
    cost_overrides: tuple[tuple[str, float], ...] = ()
    """Cost-model coefficient overrides by name (see `dualpath.sched.cost`)."""
    step_costs: ProfiledCosts | None = None
    """The engines' measured step costs (`dualpath profile`), charged in place of the roofline
    cost model (`dualpath.sched.cost`) for prefill passes, decode steps and packing; None: the
    roofline model with the (model, hardware) coefficients."""

    def __post_init__(self) -> None:
        if self.driver.kind == "replay" and self.workload.arrival_s is None:
            raise SpecError("sim", "workload.arrival_s", None, "a replay driver needs timestamps")
        non_negative_int("sim", "seed", self.seed)
        bs = self.params.block_size_tokens
        bad = np.flatnonzero(self.workload.hit_tokens % bs)
        if len(bad):
            i = int(bad[0])
            raise SpecError("sim", f"workload.hit_tokens[{i}]", int(self.workload.hit_tokens[i]),
                            f"must be a multiple of the block size {bs} (only Full Blocks are "
                            "stored)")

    def with_mode(self, mode: Mode | str) -> SimConfig:
        """A copy running another mode (a name from MODE_PRESETS or a Mode)."""
        return replace(self, mode=mode_preset(mode) if isinstance(mode, str) else mode)
