"""One simulator run per `RunSpec`, cached per process so experiments that share a point (the
ablation and Fig. 13, Fig. 7 and the split-read study) run it once; wall times are logged so the
report can state what each experiment cost."""

from __future__ import annotations

import contextlib
import multiprocessing
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from functools import cache
from typing import TYPE_CHECKING, Any, TypeVar

from tqdm import tqdm

from dualpath.core.errors import SpecError
from dualpath.core.read_rate import StorageReadModel
from dualpath.plan.ray_backend import TaskFailure
from dualpath.plan.setups import setup
from dualpath.sim import Driver, SimConfig, SimParams, SimResult, Workload, mode_preset, simulate
from dualpath.sim.workload import agent_workload

if TYPE_CHECKING:
    from dualpath.plan.ray_backend import RayBackend

MAL_TOKENS = {"32k": 32 * 1024, "48k": 48 * 1024, "64k": 64 * 1024}
"""The Table-2 traces by name, with their MaxLen in tokens."""

T = TypeVar("T")
R = TypeVar("R")


def mal_tokens(mal: str) -> tuple[str, int]:
    """(Table-2 trace, truncation length in tokens) of a `RunSpec.mal`: `64k` is the 64k trace
    cut at 64K tokens (its MaxLen), `32k@2048` the 32k trace cut at 2,048 (an engine with a
    short context)."""
    trace, at, cap = mal.partition("@")
    if trace not in MAL_TOKENS:
        raise SpecError("run", "mal", mal, f"must be one of {', '.join(MAL_TOKENS)}, "
                        "optionally @TOKENS")
    if not at:
        return trace, MAL_TOKENS[trace]
    if not cap.isdigit() or not 2 <= int(cap) <= MAL_TOKENS[trace]:
        raise SpecError("run", "mal", mal, f"the length after @ must be an integer in "
                        f"[2, {MAL_TOKENS[trace]}]")
    return trace, int(cap)


@dataclass(frozen=True)
class RunSpec:
    """One point of one experiment. `mal` names the Table-2 trace and its truncation length
    (`32k`; `32k@2048`: that trace cut at 2,048 tokens, `mal_tokens`); `aps > 0` makes it an
    online run of `max_duration_s` simulated seconds."""

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
    calibrated record (`dualpath.core.read_rate`)."""
    scheduler_overrides: tuple[tuple[str, str], ...] = ()
    """`SchedulerParams` fields by name over the derived defaults (`SimConfig.scheduler_overrides`),
    e.g. `(("dual_tie_side", "balanced"),)`."""

    def __post_init__(self) -> None:
        mal_tokens(self.mal)
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

    @property
    def name(self) -> str:
        """The spec in words (a task's name): setup, P/D, mode, load, trace and any
        non-default knob."""
        pd = (f" {self.num_prefill_nodes}P{self.num_decode_nodes}D"
              if self.num_prefill_nodes else "")
        load = (f"{self.aps:g} APS {self.max_duration_s:g} s" if self.is_online
                else f"{self.num_agents} agents")
        extra = [f"{k} {v:g}" for k, v in (("append x", self.append_factor),
                                            ("gen x", self.gen_factor)) if v != 1.0]
        extra += [f"seed {self.seed}"] * (self.seed != 0)
        extra += [f"ep {self.ep_engines[0]}/{self.ep_engines[1]}"] * (self.ep_engines != (0, 0))
        if self.storage is not None:
            extra.append(f"storage {self.storage[0]:g}/{self.storage[1]:g}")
        extra += [f"{k} {v:g}" for k, v in self.cost_overrides]
        extra += [f"{k} {v}" for k, v in self.scheduler_overrides]
        return " ".join([f"{self.setup}{pd} {self.mode} {load} {self.mal}", *extra])

    def config(self) -> SimConfig:
        """The simulator configuration of this point."""
        s = setup(self.setup)
        cluster = s.cluster(self.num_prefill_nodes or None, self.num_decode_nodes or None)
        if self.is_online:
            driver = Driver(kind="online", num_agents=self.num_agents, agents_per_s=self.aps,
                            max_duration_s=self.max_duration_s, ttft_limit_s=self.ttft_abort_s)
        else:
            driver = Driver(kind="offline", num_agents=self.num_agents)
        params = SimParams(prefill_ep_engines=self.ep_engines[0],
                           decode_ep_engines=self.ep_engines[1],
                           storage_read=(None if self.storage is None
                                         else StorageReadModel(*self.storage)))
        extra = s.sim_kwargs()
        if "params" in extra:  # a profiled engine's cluster sets its own physical details
            own = extra.pop("params")
            params = replace(own, prefill_ep_engines=params.prefill_ep_engines,
                             decode_ep_engines=params.decode_ep_engines,
                             storage_read=params.storage_read or own.storage_read)
        trace, cap = mal_tokens(self.mal)
        made = s.workload(trace, cap, self.num_agents, self.seed, params.block_size_tokens)
        workload = made if made is not None else _workload(
            self.mal, self.num_agents, self.append_factor, self.gen_factor, self.seed,
            params.block_size_tokens)
        return SimConfig(
            cluster, workload,
            mode=mode_preset(self.mode), driver=driver, seed=self.seed,
            cost_overrides=self.cost_overrides, params=params,
            scheduler_overrides=self.scheduler_overrides, **extra,
        )


NOMINAL_STORAGE = (1.0, 0.0)
"""`RunSpec.storage` of a run whose storage NICs move KV at their line rate."""


def block_bytes(setup_name: str) -> float:
    """Bytes of one Full Block of a setup's model at its block size (a profiled engine's own,
    else the simulator's)."""
    s = setup(setup_name)
    params = s.sim_kwargs().get("params", SimParams())
    return float(s.cluster().model.kv_bytes_per_token * params.block_size_tokens)


def storage_fraction(model: StorageReadModel, setup_name: str) -> float:
    """The fraction of its line rate a setup's storage NIC reads that setup's Full Blocks at
    under `model`."""
    nominal = setup(setup_name).cluster().hardware.storage_nic_bytes_per_s
    return model.read_bytes_per_s(nominal, block_bytes(setup_name)) / nominal


def run_storage(model: StorageReadModel, setup_name: str) -> tuple[float, float]:
    """`RunSpec.storage` that reads the setup's Full Blocks as `model` does: one run sees one
    block size, so any form is one flat rate there."""
    return (storage_fraction(model, setup_name), 0.0)


@cache
def _workload(mal: str, num_agents: int, append: float, gen: float, seed: int,
              block_size: int = 64) -> Workload:
    # Each MAL column of Fig. 7 uses the dataset of that MaxLen, truncated at the MAL (§7.3).
    trace, tokens = mal_tokens(mal)
    return agent_workload(trace, num_agents, seed=seed, max_len_tokens=tokens,
                          append_factor=append, gen_factor=gen, block_size=block_size)


def _simulate(spec: RunSpec) -> tuple[SimResult, float]:
    started = time.perf_counter()
    result = simulate(spec.config())
    return result, time.perf_counter() - started


@dataclass
class Runner:
    """Runs and caches `RunSpec`s; `log` holds (spec, wall seconds) of every fresh run.

    `prefetch` (and `fan_out` for other independent work) runs in `jobs` processes, or as tasks
    on the Ray cluster `ray`; a run is deterministic in its spec, so the results are those of a
    serial run wherever they were made."""

    on_run: Callable[[RunSpec, SimResult, float], None] | None = None
    cache: dict[RunSpec, SimResult] = field(default_factory=dict)
    log: list[tuple[RunSpec, float]] = field(default_factory=list)
    jobs: int = 1
    ray: RayBackend | None = None
    """Fan out on this Ray cluster instead of `jobs` processes."""
    progress: bool = False
    """A bar on stderr per fan-out: tasks done of total, with an ETA."""
    node_of: dict[RunSpec, str] = field(default_factory=dict)
    """Where each run made on a Ray cluster ran (the node's address)."""
    failures: list[TaskFailure] = field(default_factory=list)
    """Tasks that failed on the Ray cluster after its retries (then run here)."""

    @property
    def is_parallel(self) -> bool:
        return self.ray is not None or self.jobs > 1

    def run(self, spec: RunSpec) -> SimResult:
        """The result of `spec`, simulated on first request."""
        hit = self.cache.get(spec)
        if hit is not None:
            return hit
        result, wall = _simulate(spec)
        self.store(spec, result, wall)
        return result

    def prefetch(self, specs: Iterable[RunSpec]) -> None:
        """Simulate the specs not cached yet, `jobs` at a time or on the Ray cluster (in
        order when serial); later `run` calls return them from the cache. A spec whose task
        failed on the cluster is simulated here when `run` asks for it."""
        todo = list(dict.fromkeys(s for s in specs if s not in self.cache))
        if self.ray is None and (self.jobs <= 1 or len(todo) <= 1):
            for spec in todo:
                self.run(spec)
            return
        if not todo:
            return
        # Longest first (agents x turns grow together), so one big run does not end last.
        todo.sort(key=lambda s: -s.num_agents)

        def done(i: int, out: tuple[SimResult, float], node: str) -> None:
            self.store(todo[i], *out, node=node)

        self.fan_out(_simulate, todo, [s.name for s in todo], done)

    def fan_out(self, fn: Callable[[T], R], items: Sequence[T], names: Sequence[str],
                done: Callable[[int, R, str], None]) -> list[int]:
        """`fn` of every item, on the Ray cluster or in `jobs` processes; `done(index, result,
        node)` here as each completes (node: its address on Ray, else ""). Returns the indices
        that failed on the cluster after Ray's retries, each reported by name on stderr; with
        processes a failure raises, as a serial run would."""
        failed: list[int] = []
        with _progress(len(items), self.progress) as bar:
            for i, out, node in self._completed(fn, items, names):
                with bar.writing() if bar is not None else contextlib.nullcontext():
                    if isinstance(out, TaskFailure):
                        failed.append(i)
                        self.failures.append(out)
                        print(f"task {out.name!r} failed on the cluster ({out.error}); it runs "
                              "here instead", file=sys.stderr, flush=True)
                    else:
                        done(i, out, node)
                if bar is not None:
                    bar.update()
        return failed

    def _completed(self, fn: Callable[[T], R], items: Sequence[T],
                   names: Sequence[str]) -> Iterator[tuple[int, R | TaskFailure, str]]:
        if self.ray is not None:
            yield from self.ray.imap(fn, items, names)
            return
        ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        with ProcessPoolExecutor(min(self.jobs, len(items)), mp_context=ctx) as pool:
            futures = {pool.submit(fn, item): i for i, item in enumerate(items)}
            for fut in as_completed(futures):
                yield futures[fut], fut.result(), ""

    def store(self, spec: RunSpec, result: SimResult, wall: float, node: str = "") -> None:
        """Record a run made elsewhere (a worker process, a Ray node) as if made here."""
        self.cache[spec] = result
        self.log.append((spec, wall))
        if node:
            self.node_of[spec] = node
        if self.on_run is not None:
            self.on_run(spec, result, wall)

    @property
    def wall_s(self) -> float:
        """Seconds spent simulating so far."""
        return sum(w for _, w in self.log)

    def where(self) -> str:
        """Runs per Ray node, e.g. `7 on 10.0.0.10, 5 on 10.0.0.11` ("" without Ray)."""
        counts: dict[str, int] = {}
        for node in self.node_of.values():
            counts[node] = counts.get(node, 0) + 1
        return ", ".join(f"{n} on {node}" for node, n in sorted(counts.items()))


class _Progress:
    """Tasks done of total with an ETA on stderr: a tqdm bar on a terminal, else a line at
    most every `LINE_EVERY_S` (and at the end), which a log keeps readable."""

    LINE_EVERY_S = 10.0

    def __init__(self, total: int) -> None:
        self.total = total
        self.num_done = 0
        self.started = self.last_line = time.perf_counter()
        self.bar = (tqdm(total=total, desc="sweep", unit="task", file=sys.stderr, leave=False)
                    if sys.stderr.isatty() else None)

    def writing(self) -> contextlib.AbstractContextManager[Any]:
        """Around a line printed to stderr while the bar is shown."""
        if self.bar is None:
            return contextlib.nullcontext()
        return tqdm.external_write_mode(file=sys.stderr)

    def update(self) -> None:
        self.num_done += 1
        if self.bar is not None:
            self.bar.update(1)
            return
        now = time.perf_counter()
        if now - self.last_line >= self.LINE_EVERY_S or self.num_done == self.total:
            self.last_line = now
            elapsed = now - self.started
            eta = elapsed / self.num_done * (self.total - self.num_done)
            print(f"sweep: {self.num_done}/{self.total} tasks done, {elapsed:.0f} s, ETA "
                  f"{eta:.0f} s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def _progress(total: int, shown: bool) -> Iterator[_Progress | None]:
    """A `_Progress` of `total` tasks (None when not `shown`)."""
    if not shown:
        yield None
        return
    progress = _Progress(total)
    try:
        yield progress
    finally:
        progress.close()
