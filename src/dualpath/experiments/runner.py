"""One simulator run per `RunSpec`, cached per process so experiments that share a point (the
ablation and Fig. 13, Fig. 7 and the split-read study) run it once; wall times are logged so the
report can state what each experiment cost."""

from __future__ import annotations

import multiprocessing
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from functools import cache

from dualpath.core.errors import SpecError
from dualpath.core.storage import StorageReadModel
from dualpath.experiments.paper import MAL_TOKENS
from dualpath.experiments.setups import setup
from dualpath.sim import Driver, SimConfig, SimParams, SimResult, Workload, mode_preset, simulate
from dualpath.sim.workload import agent_workload


@dataclass(frozen=True)
class RunSpec:
    """One point of one experiment. `mal` names the Table-2 trace and its truncation length;
    `aps > 0` makes it an online run of `max_duration_s` simulated seconds."""

    setup: str
    mode: str
    num_agents: int
    mal: str = "64k"
    append_factor: float = 1.0
    gen_factor: float = 1.0
    aps: float = 0.0
    max_duration_s: float = 3600.0
    ttft_abort_s: float = 20.0
    """Online: stop the run once one turn's TTFT exceeds this (clearly past the 4 s SLO)."""
    num_prefill_nodes: int = 0
    """0: the setup's default."""
    num_decode_nodes: int = 0
    cost_overrides: tuple[tuple[str, float], ...] = ()
    seed: int = 0
    ep_engines: tuple[int, int] = (0, 0)
    """Engines per expert-parallel group, (prefill, decode); 0: the whole side (`SimParams`)."""
    storage: tuple[float, float] | None = None
    """The storage read model as (read_efficiency, per_block_overhead_s); None: the hardware's
    calibrated record (`dualpath.core.storage`)."""

    def __post_init__(self) -> None:
        if self.mal not in MAL_TOKENS:
            raise SpecError("run", "mal", self.mal, f"must be one of {', '.join(MAL_TOKENS)}")
        if self.num_agents < 1:
            raise SpecError("run", "num_agents", self.num_agents, "must be >= 1")
        s = setup(self.setup)
        mode_preset(self.mode)
        # The setup's own P/D spelled out is the same run as the default: one cache key.
        if (self.num_prefill_nodes, self.num_decode_nodes) == (s.num_prefill_nodes,
                                                               s.num_decode_nodes):
            object.__setattr__(self, "num_prefill_nodes", 0)
            object.__setattr__(self, "num_decode_nodes", 0)

    @property
    def is_online(self) -> bool:
        return self.aps > 0

    def config(self) -> SimConfig:
        """The simulator configuration of this point."""
        s = setup(self.setup)
        cluster = s.cluster(self.num_prefill_nodes or None, self.num_decode_nodes or None)
        if self.is_online:
            driver = Driver(kind="online", num_agents=self.num_agents, agents_per_s=self.aps,
                            max_duration_s=self.max_duration_s, ttft_limit_s=self.ttft_abort_s)
        else:
            driver = Driver(kind="offline", num_agents=self.num_agents)
        return SimConfig(
            cluster, _workload(self.mal, self.num_agents, self.append_factor, self.gen_factor,
                               self.seed),
            mode=mode_preset(self.mode), driver=driver, seed=self.seed,
            cost_overrides=self.cost_overrides,
            params=SimParams(prefill_ep_engines=self.ep_engines[0],
                             decode_ep_engines=self.ep_engines[1],
                             storage_read=(None if self.storage is None
                                           else StorageReadModel(*self.storage))),
        )


NOMINAL_STORAGE = (1.0, 0.0)
"""`RunSpec.storage` of a run whose storage NICs move KV at their line rate."""


@cache
def _workload(mal: str, num_agents: int, append: float, gen: float, seed: int) -> Workload:
    # Each MAL column of Fig. 7 uses the dataset of that MaxLen, truncated at the MAL (§7.3).
    return agent_workload(mal, num_agents, seed=seed, max_len_tokens=MAL_TOKENS[mal],
                          append_factor=append, gen_factor=gen)


def _simulate(spec: RunSpec) -> tuple[SimResult, float]:
    started = time.perf_counter()
    result = simulate(spec.config())
    return result, time.perf_counter() - started


@dataclass
class Runner:
    """Runs and caches `RunSpec`s; `log` holds (spec, wall seconds) of every fresh run.

    With `jobs > 1`, `prefetch` simulates independent specs in that many processes; a run is
    deterministic in its spec, so the results are those of a serial run."""

    on_run: Callable[[RunSpec, SimResult, float], None] | None = None
    cache: dict[RunSpec, SimResult] = field(default_factory=dict)
    log: list[tuple[RunSpec, float]] = field(default_factory=list)
    jobs: int = 1

    def run(self, spec: RunSpec) -> SimResult:
        """The result of `spec`, simulated on first request."""
        hit = self.cache.get(spec)
        if hit is not None:
            return hit
        result, wall = _simulate(spec)
        self.store(spec, result, wall)
        return result

    def prefetch(self, specs: Iterable[RunSpec]) -> None:
        """Simulate the specs not cached yet, `jobs` at a time (in order when `jobs` is 1);
        later `run` calls return them from the cache."""
        todo = list(dict.fromkeys(s for s in specs if s not in self.cache))
        if self.jobs <= 1 or len(todo) <= 1:
            for spec in todo:
                self.run(spec)
            return
        # Longest first (agents x turns grow together), so one big run does not end last.
        todo.sort(key=lambda s: -s.num_agents)
        ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        with ProcessPoolExecutor(min(self.jobs, len(todo)), mp_context=ctx) as pool:
            futures = {pool.submit(_simulate, s): s for s in todo}
            for fut in as_completed(futures):
                result, wall = fut.result()
                self.store(futures[fut], result, wall)

    def store(self, spec: RunSpec, result: SimResult, wall: float) -> None:
        """Record a run made elsewhere (a worker process) as if made here."""
        self.cache[spec] = result
        self.log.append((spec, wall))
        if self.on_run is not None:
            self.on_run(spec, result, wall)

    @property
    def wall_s(self) -> float:
        """Seconds spent simulating so far."""
        return sum(w for _, w in self.log)
