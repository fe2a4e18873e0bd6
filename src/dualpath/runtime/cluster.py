"""An emulated PD-disaggregated cluster on one machine, and the offline agentic batch driver.

`Cluster` starts the scheduler (`scheduler.serve_scheduler`) and one node per process (or
each per thread, for fast tests) and wires their message queues; the calling process is only
the driver (a client): it submits turns to the scheduler and learns of finished ones. It replays
agents: each agent's next turn is submitted when its previous turn is done, with the context
grown by the turn's real output and the next append (so the previous turn's persisted blocks
are the next turn's cache hits). Nodes `[0, P)` are prefill nodes, `[P, P+D)` decode nodes.

Modes: the simulator's `dualpath.sched.mode.Mode` presets, by name, so every ablation step runs
here too: `basic` = PE read path only, no layerwise prefill, round-robin scheduling;
`layerwise` = basic with layerwise prefill; `dual-path` = layerwise with the shorter-read-queue
path choice; `dualpath` = that with the paper's scheduler; `split` = dualpath splitting each
read across both sides; `oracle` = dualpath with storage I/O and P-D transfers not paced (bytes
still move, so outputs are the same). (The runtime's PEs pack every forward pass under the
compute quota in every mode; the scheduler switch changes only inter-engine scheduling.)

What is emulated and what is not: storage NICs (read and write per node) and compute NICs (tx and
rx per engine, including the CNIC-assisted H2D/D2H copies and the receiving engine's side of
P-D transfers) are rate limited; DRAM bandwidth (`M`) is not, and the high-priority class of the
compute NICs carries nothing (engines are single-GPU: no collectives). A PE packs each forward
pass under a compute quota (`sched.pack_prefill_batch`, chunking a prompt that does not fit) and
runs the packed requests back to back per layer (`prefill_engine`). Buffers must hold the prompts in
flight on both sides (`dualpath run` sizes them so); a PE and a DE buffer that are both too small
could otherwise wait on each other.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import multiprocessing.queues
import os
import queue
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dualpath.core.blocks import block_keys
from dualpath.core.errors import DualPathError, SpecError
from dualpath.core.validate import positive, positive_int
from dualpath.runtime.estimator import ESTIMATORS
from dualpath.runtime.kvlayout import KVLayout
from dualpath.runtime.messages import (
    Cancel,
    Inbox,
    Message,
    NodeFailed,
    NodeStats,
    NodeUp,
    Peers,
    SchedulerStats,
    Shutdown,
    Submitted,
    TurnDone,
    TurnTokens,
)
from dualpath.runtime.model_source import ModelSource, model_config
from dualpath.runtime.node import run_node
from dualpath.runtime.node_context import NodeConfig
from dualpath.runtime.sampling import SamplingParams
from dualpath.runtime.scheduler import SCHEDULER_NODE, SchedulerConfig, serve_scheduler
from dualpath.runtime.store import BlockStore
from dualpath.runtime.transfer import SegmentInfo
from dualpath.sched.mode import MODE_PRESETS, Mode, mode_preset
from dualpath.sched.params import PathMode, SchedulerParams
from dualpath.sched.types import ReadSide, WaitingRequest
from dualpath.workload.tokens import RandomTokens
from dualpath.workload.trajectory import Trajectory

MODES = tuple(MODE_PRESETS)
LAUNCHES = ("process", "thread")
# The emulated cluster runs on one machine: nodes are processes, engines threads. Past these
# a run would only thrash (or take minutes to start and leak its semaphores if killed).
MAX_NODES = 64
MAX_ENGINES_PER_NODE = 64
MAX_BLOCK_SIZE_TOKENS = 4096


class RunError(DualPathError):
    """A node failed or the run could not finish."""


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
    read_tie_side: str = "pe"
    """Where the dual-path rule reads when both read queues are equal (sched default: PE)."""
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
        if self.read_tie_side not in ("pe", "de"):
            raise SpecError(owner, "read_tie_side", self.read_tie_side, "must be pe or de")
        if self.path_mode not in (None, "pe", "dual", "split", "de"):
            raise SpecError(owner, "path_mode", self.path_mode, "must be pe, dual, split or de")
        for name in (
            "num_prefill_nodes",
            "num_decode_nodes",
            "engines_per_node",
            "buffer_bytes",
            "hbm_bytes",
            "block_size",
        ):
            positive_int(owner, name, getattr(self, name))
        for name, value, limit in (
            ("num_prefill_nodes + num_decode_nodes", self.num_nodes, MAX_NODES),
            ("engines_per_node", self.engines_per_node, MAX_ENGINES_PER_NODE),
            ("block_size", self.block_size, MAX_BLOCK_SIZE_TOKENS),
        ):
            if value > limit:
                raise SpecError(owner, name, value, f"at most {limit} on this one-machine "
                                "emulated cluster")
        positive(owner, "storage_nic_bytes_per_s", self.storage_nic_bytes_per_s)
        positive(owner, "compute_nic_bytes_per_s", self.compute_nic_bytes_per_s)
        positive(owner, "compute_quota_s", self.compute_quota_s)
        if self.max_batch_tokens is not None:
            positive_int(owner, "max_batch_tokens", self.max_batch_tokens)
        if self.estimator not in ESTIMATORS:
            raise SpecError(
                owner, "estimator", self.estimator, f"must be one of {', '.join(ESTIMATORS)}"
            )

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


@dataclass(frozen=True)
class AgentScript:
    """One agent to replay: the token ids each turn appends and the tokens it generates."""

    agent_id: int
    appends: tuple[tuple[int, ...], ...]
    gen_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.appends) != len(self.gen_tokens) or not self.appends:
            raise SpecError(
                f"agent[{self.agent_id}]",
                "appends",
                len(self.appends),
                f"needs one entry per turn ({len(self.gen_tokens)} gen_tokens)",
            )


def agents_from_lengths(
    turns: Sequence[tuple[Sequence[int], Sequence[int]]], vocab_size: int, seed: int
) -> list[AgentScript]:
    """Agents from `(append lengths, gen lengths)` per agent, with the workload's deterministic
    token ids (`workload.tokens.RandomTokens`, seeded by `(seed, agent, turn)`), so every run
    replays the same prompts."""
    source = RandomTokens(vocab_size, seed)
    return [
        AgentScript(
            a,
            tuple(tuple(source.append_ids(a, k, int(n))) for k, n in enumerate(appends)),
            tuple(int(g) for g in gens),
        )
        for a, (appends, gens) in enumerate(turns)
    ]


def agents_from_trajectories(
    trajectories: Sequence[Trajectory], vocab_size: int, seed: int
) -> list[AgentScript]:
    """One agent per trajectory (see `agents_from_lengths`)."""
    return agents_from_lengths(
        [(t.append_tokens, t.gen_tokens) for t in trajectories], vocab_size, seed
    )


@dataclass
class TurnRecord:
    """What happened to one turn."""

    agent_id: int
    turn_index: int
    request_id: int
    prompt_tokens: int
    hit_tokens: int
    output_ids: tuple[int, ...]
    submitted_at: float
    first_token_at: float
    done_at: float


@dataclass
class RunResult:
    """A finished run: per-turn records, per-node counters, and what is derived from them."""

    config: RunConfig
    turns: list[TurnRecord]
    nodes: list[NodeStats]
    started_at: float
    finished_at: float
    num_fetches: int = 0
    outputs: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)
    """agent -> output ids per turn."""

    @property
    def jct_s(self) -> float:
        """Job completion time: first submission to the last turn's end."""
        return self.finished_at - self.started_at

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(t.output_ids) for t in self.turns)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(t.prompt_tokens for t in self.turns)

    @property
    def num_hit_tokens(self) -> int:
        return sum(t.hit_tokens for t in self.turns)

    @property
    def tokens_per_s(self) -> float:
        """Prompt plus generated tokens processed per second of JCT."""
        return (self.num_prompt_tokens + self.num_generated_tokens) / self.jct_s

    def is_prefill_node(self, node: int) -> bool:
        return node < self.config.num_prefill_nodes

    def bytes_by_path(self) -> dict[str, int]:
        """Bytes moved per hop over all nodes; `pe_read` / `de_read` are the storage reads of
        prefill / decode nodes (the two read paths)."""
        out: dict[str, int] = defaultdict(int)
        for n in self.nodes:
            for path, b in n.bytes_by_path.items():
                if path == "snic_read":
                    out["pe_read" if self.is_prefill_node(n.node) else "de_read"] += b
                else:
                    out[path] += b
        return dict(out)

    def snic_read_utilization(self) -> dict[int, float]:
        """Per node: busy time of its storage NIC's read port over the JCT."""
        return {
            n.node: sum(v for k, v in n.port_busy_s.items() if k.endswith("snic.read")) / self.jct_s
            for n in self.nodes
        }

    def store_counters(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for n in self.nodes:
            for k, v in n.store_counters.items():
                out[k] += v
        return dict(out)

    @property
    def num_unpersisted_blocks(self) -> int:
        """KV blocks that were computed but could not be persisted (see `Cluster`)."""
        return self.store_counters().get("num_failed_puts", 0)

    def engine_counters(self) -> dict[str, int]:
        """PE forward-pass counters summed over nodes (see `NodeStats.engine_counters`)."""
        out: dict[str, int] = defaultdict(int)
        for n in self.nodes:
            for k, v in n.engine_counters.items():
                out[k] += v
        return dict(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.config.mode,
            "jct_s": self.jct_s,
            "tokens_per_s": self.tokens_per_s,
            "generated_tokens": self.num_generated_tokens,
            "prompt_tokens": self.num_prompt_tokens,
            "hit_tokens": self.num_hit_tokens,
            "num_turns": len(self.turns),
            "bytes_by_path": self.bytes_by_path(),
            "snic_read_utilization": {str(k): v for k, v in self.snic_read_utilization().items()},
            "store": self.store_counters(),
            "unpersisted_blocks": self.num_unpersisted_blocks,
            "buffer_peak_slots": {str(n.node): n.buffer_peak_slots for n in self.nodes},
            "num_fetches": self.num_fetches,
            "engine": self.engine_counters(),
            "pe_estimator": [n.estimator for n in self.nodes if n.estimator],
        }


def scheduler_params(cfg: RunConfig, layout: KVLayout) -> SchedulerParams:
    """The paper's parameters for this run (alpha: 3 s of storage-NIC reads)."""
    alpha = cfg.alpha_tokens
    if alpha is None:
        alpha = cfg.storage_nic_bytes_per_s * 3.0 / layout.kv_bytes_per_token
        if cfg.is_oracle or alpha == float("inf"):
            alpha = 1e12
    mode = cfg.path_mode or cfg.switches.paths
    return SchedulerParams(
        alpha_tokens=alpha,
        beta_tokens=cfg.beta_tokens,
        kv_bytes_per_token=layout.kv_bytes_per_token,
        block_size_tokens=cfg.block_size,
        path_mode=PathMode.PE if mode in ("pe", "de") else PathMode(mode),
        dual_tie_side=ReadSide(cfg.read_tie_side),
    )


def _check_memory(cfg: RunConfig) -> None:
    """SpecError if the cluster's buffers and KV memory exceed this machine's memory, before
    anything starts (later, a node's segment fails with ENOMEM or the kernel kills it)."""
    machine_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if cfg.memory_bytes > machine_bytes:
        raise SpecError(
            "run", "buffer_bytes", cfg.buffer_bytes,
            f"{cfg.num_nodes} node buffers plus {cfg.num_decode_nodes * cfg.engines_per_node} "
            f"decode engines x hbm_bytes={cfg.hbm_bytes} need {cfg.memory_bytes} bytes, more "
            f"than this machine's {machine_bytes}",
        )


_LIVENESS_POLL_S = 1.0
"""How often the driver checks, while waiting for a message, that its processes are alive."""


class Cluster:
    """Nodes started, connected and serving; `run` replays agents; `close` stops them."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        _check_memory(cfg)
        config = model_config(cfg.model)
        self.vocab_size: int = config.vocab_size
        self.layout: KVLayout = config.kv_layout(cfg.block_size)
        self.max_position_tokens: int = config.max_position_tokens
        # The driver looks up each prompt's cache hit (what `WaitingRequest` carries); the
        # scheduler process decides everything else.
        self._store = BlockStore(cfg.store_root, self.layout.full_block_bytes, is_durable=False)
        self._request_ids = itertools.count()
        self._lock = threading.Lock()
        self._prefix = f"dp{os.getpid() % 100000}{uuid.uuid4().hex[:6]}"
        self._procs: list[Any] = []
        self._is_closed = False
        self.failure_traceback = ""
        self._failed_nodes: set[int] = set()
        self.live_stats: dict[int, NodeStats] = {}
        """Each node's latest running counters (with `stats_interval_s`), by node id."""
        self._next_liveness_check = 0.0
        """Traceback of the node failure that aborted the run, if any (for debugging)."""
        self._num_fetches = 0
        is_process = cfg.launch == "process"
        # Written by each node's storage writer, read here while the cluster serves.
        self._unpersisted: Any = mp.get_context("spawn").RawArray("q", cfg.num_nodes)
        if is_process:
            ctx = mp.get_context("spawn")
            self._sched_q: Inbox = ctx.Queue()
            self._driver_q: Inbox = ctx.Queue()
            self._inboxes: dict[int, Inbox] = {n: ctx.Queue() for n in range(cfg.num_nodes)}
        else:
            self._sched_q = queue.Queue()
            self._driver_q = queue.Queue()
            self._inboxes = {n: queue.Queue() for n in range(cfg.num_nodes)}
        sched_cfg = SchedulerConfig(
            params=scheduler_params(cfg, self.layout),
            num_prefill_nodes=cfg.num_prefill_nodes,
            num_decode_nodes=cfg.num_decode_nodes,
            engines_per_node=cfg.engines_per_node,
            is_round_robin=cfg.switches.is_round_robin,
            forced_read_side="de" if cfg.path_mode == "de" else None,
        )
        sched_args = (sched_cfg, self._sched_q, self._inboxes, self._driver_q)
        if is_process:
            self._scheduler: Any = mp.get_context("spawn").Process(
                target=serve_scheduler, args=sched_args, name="dualpath-scheduler", daemon=True
            )
        else:
            self._scheduler = threading.Thread(
                target=serve_scheduler, args=sched_args, name="scheduler", daemon=True
            )
        self._scheduler.start()
        for n in range(cfg.num_nodes):
            ncfg = self._node_config(n)
            args = (ncfg, self._inboxes[n], self._inboxes, self._sched_q, is_process,
                    self._unpersisted)
            if is_process:
                proc: Any = mp.get_context("spawn").Process(
                    target=run_node, args=args, name=f"dualpath-node{n}", daemon=True
                )
            else:
                proc = threading.Thread(target=run_node, args=args, name=f"node{n}", daemon=True)
            proc.start()
            self._procs.append(proc)
        try:
            self._connect()
        except BaseException:
            self.close()
            raise

    def _node_config(self, node: int) -> NodeConfig:
        cfg = self.cfg
        return NodeConfig(
            node=node,
            is_prefill=node < cfg.num_prefill_nodes,
            num_engines=cfg.engines_per_node,
            layout=self.layout,
            model=cfg.model,
            store_root=cfg.store_root,
            buffer_bytes=cfg.buffer_bytes,
            storage_nic_bytes_per_s=cfg.storage_nic_bytes_per_s,
            compute_nic_bytes_per_s=cfg.compute_nic_bytes_per_s,
            is_io_unpaced=cfg.is_oracle,
            hbm_bytes=cfg.hbm_bytes,
            is_layerwise=cfg.is_layerwise,
            transfer_kind=cfg.transfer_kind,
            shm_prefix=self._prefix,
            fetch_interval_s=cfg.fetch_interval_s,
            compute_quota_s=cfg.compute_quota_s,
            max_batch_tokens=cfg.max_batch_tokens,
            estimator=cfg.estimator,
            stats_interval_s=cfg.stats_interval_s,
        )

    def _get(self, timeout_s: float, is_timeout_ok: bool = False) -> Message | None:
        deadline = time.monotonic() + timeout_s
        while True:
            # On a clock, not only when the queue is idle: under steady traffic from the
            # other nodes a killed one must still be noticed within a second.
            if time.monotonic() >= self._next_liveness_check:
                self._next_liveness_check = time.monotonic() + _LIVENESS_POLL_S
                self._raise_if_a_process_died()
            try:
                # Short waits: a process that dies before it can report (a crash while
                # starting, a kill) is noticed within a second, not at the timeout.
                msg: Message = self._driver_q.get(
                    timeout=min(_LIVENESS_POLL_S, max(0.0, deadline - time.monotonic()))
                )
                break
            except queue.Empty:
                self._raise_if_a_process_died()
                if time.monotonic() >= deadline:
                    if is_timeout_ok:
                        return None
                    raise RunError(
                        f"no message from the cluster within {timeout_s:g} s"
                    ) from None
        if isinstance(msg, NodeStats) and not msg.is_final:
            self.live_stats[msg.node] = msg
            return self._get(max(0.0, deadline - time.monotonic()), is_timeout_ok)
        if isinstance(msg, NodeFailed):
            self._failed_nodes.add(msg.node)
            self.failure_traceback = msg.traceback
            who = "scheduler" if msg.node == SCHEDULER_NODE else f"node {msg.node}"
            raise RunError(f"{who} failed: {msg.error}")
        return msg

    def _raise_if_a_process_died(self) -> None:
        """RunError naming the first node or scheduler process that exited without being
        told to (threads, in `launch="thread"`, report their failures as messages)."""
        for p, who in [(self._scheduler, "scheduler"),
                       *((p, f"node {n}") for n, p in enumerate(self._procs))]:
            if isinstance(p, mp.process.BaseProcess) and p.exitcode is not None:
                # Recorded, so `close` does not wait for stats it can never get.
                self._failed_nodes.add(SCHEDULER_NODE if p is self._scheduler
                                       else self._procs.index(p))
                raise RunError(f"{who} process exited with code {p.exitcode} before reporting "
                               "(see its output above)")

    def _connect(self, timeout_s: float = 300.0) -> None:
        segments: dict[int, SegmentInfo] = {}
        while len(segments) < self.cfg.num_nodes:
            msg = self._get(timeout_s)
            if isinstance(msg, NodeUp):
                segments[msg.node] = msg.segment
        peers = Peers(tuple(segments[n] for n in sorted(segments)))
        for inbox in self._inboxes.values():
            inbox.put(peers)

    def run(
        self,
        agents: Sequence[AgentScript],
        on_turn: Callable[[TurnRecord], object] | None = None,
        timeout_s: float = 600.0,
    ) -> RunResult:
        """Replay `agents` (all start at once, offline batch) until every turn is done."""
        cfg = self.cfg
        contexts = {a.agent_id: [] for a in agents}  # type: dict[int, list[int]]
        next_turn = {a.agent_id: 0 for a in agents}
        by_agent = {a.agent_id: a for a in agents}
        in_flight: dict[int, TurnRecord] = {}
        records: list[TurnRecord] = []
        outputs: dict[int, list[tuple[int, ...]]] = {a.agent_id: [] for a in agents}

        def submit(agent: AgentScript) -> None:
            k = next_turn[agent.agent_id]
            prompt = contexts[agent.agent_id] + list(agent.appends[k])
            sampling = SamplingParams(max_tokens=agent.gen_tokens[k],
                                      temperature=cfg.temperature, is_ignore_eos=True)
            rid, hit = self.submit(prompt, sampling)
            in_flight[rid] = TurnRecord(
                agent.agent_id, k, rid, len(prompt), hit, (), time.time(), 0.0, 0.0
            )

        started_at = time.time()
        for a in agents:
            submit(a)
        while in_flight:
            msg = self._get(timeout_s)
            if not isinstance(msg, TurnDone):
                raise RunError(f"driver: unexpected message {type(msg).__name__}")
            rec = in_flight.pop(msg.request_id)
            rec.output_ids = msg.output_ids
            rec.first_token_at = msg.first_token_at
            rec.done_at = msg.done_at
            records.append(rec)
            outputs[rec.agent_id].append(msg.output_ids)
            if on_turn is not None:
                on_turn(rec)
            agent = by_agent[rec.agent_id]
            contexts[agent.agent_id] += list(agent.appends[rec.turn_index])
            contexts[agent.agent_id] += list(msg.output_ids)
            next_turn[agent.agent_id] += 1
            if next_turn[agent.agent_id] < len(agent.appends):
                submit(agent)
        finished_at = max((r.done_at for r in records), default=started_at)
        nodes = self.close()
        return RunResult(
            cfg, records, nodes, started_at, finished_at, self._num_fetches, outputs
        )

    @property
    def num_unpersisted_blocks(self) -> int:
        """KV blocks the nodes could not persist so far (a full disk, a read-only store): each
        is skipped, so a later request that would have hit it recomputes it."""
        return int(sum(self._unpersisted))

    @property
    def max_sequence_tokens(self) -> int:
        """The longest prompt + generation one request may have: a DE's engine memory and
        the model's positions bound it."""
        lay, cfg = self.layout, self.cfg
        pages = max(1, cfg.hbm_bytes // lay.full_block_bytes)
        return min(self.max_position_tokens, pages * cfg.block_size)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt a node buffer holds whole (one slot per block); a longer one
        fails the node that reads it."""
        return (self.cfg.buffer_bytes // self.layout.full_block_bytes) * self.cfg.block_size

    def submit(
        self, prompt: Sequence[int], sampling: SamplingParams, is_streaming: bool = False
    ) -> tuple[int, int]:
        """Submit one turn (thread-safe); returns `(request id, cache-hit tokens)`. Its
        `TurnDone` (and, if streaming, `TurnTokens`) come from `next_message`.

        The hit is the longest stored prefix of whole blocks, short of the last token (whose
        logits the prefill must compute). `sampling.seed` None: one derived from the run's
        seed and the request id. SpecError names a field that could never be served (more
        tokens than a DE's memory or the model's positions: the request would wait forever;
        a token id outside the vocabulary). A prompt longer than `max_prompt_tokens` fails its
        node (`BufferFullError`); a server checks it first.
        """
        cfg = self.cfg
        if not prompt:
            raise SpecError("request", "prompt", 0, "needs at least one token")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise SpecError("request", "prompt", bad,
                            f"token ids must be in [0, {self.vocab_size})")
        bad = next((t for t in sampling.stop_token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise SpecError("request", "stop_token_ids", bad,
                            f"token ids must be in [0, {self.vocab_size})")
        max_tokens = sampling.max_tokens
        if len(prompt) + max_tokens > self.max_sequence_tokens:
            raise SpecError("request", "max_tokens", max_tokens,
                            f"prompt ({len(prompt)}) + max_tokens exceeds the "
                            f"{self.max_sequence_tokens} tokens one sequence may hold")
        bs = cfg.block_size
        keys = block_keys(prompt, bs)
        num_hit = 0
        if cfg.is_cache_enabled:
            num_hit = min(self._store.longest_prefix(keys), (len(prompt) - 1) // bs)
        with self._lock:
            rid = next(self._request_ids)
        if sampling.seed is None:
            sampling = replace(sampling, seed=cfg.seed * 1_000_003 + rid)
        self._sched_q.put(
            Submitted(
                request=WaitingRequest(rid, len(prompt), num_hit * bs, max_tokens),
                token_ids=tuple(prompt),
                block_keys=tuple(keys),
                sampling=sampling,
                is_streaming=is_streaming,
            )
        )
        return rid, num_hit * bs

    def cancel(self, request_id: int) -> None:
        """End a submitted request early (thread-safe). Its `TurnDone` still comes, with the
        tokens generated so far (none if no engine had it yet); a request already done is
        left alone."""
        if not self._is_closed:
            self._sched_q.put(Cancel(request_id))

    def next_message(self, timeout_s: float) -> TurnDone | TurnTokens | None:
        """The next `TurnDone` or `TurnTokens`, or None after `timeout_s`; RunError when a
        node or the scheduler failed (one consumer at a time)."""
        while True:
            msg = self._get(timeout_s, is_timeout_ok=True)
            if msg is None or isinstance(msg, TurnDone | TurnTokens):
                return msg
            raise RunError(f"driver: unexpected message {type(msg).__name__}")

    def close(self, timeout_s: float = 30.0) -> list[NodeStats]:
        """Stop every node, then the scheduler; returns the nodes' counters (those that
        answered; their stats reach the driver through the scheduler)."""
        if self._is_closed:
            return []
        self._is_closed = True
        for inbox in self._inboxes.values():
            inbox.put(Shutdown())
        stats: dict[int, NodeStats] = {}
        deadline = time.monotonic() + timeout_s
        # A failed node sends no stats; it has already left its loop. A failed scheduler
        # forwards nothing.
        is_sched_alive = SCHEDULER_NODE not in self._failed_nodes
        while (
            is_sched_alive
            and len(stats) + len(self._failed_nodes) < len(self._procs)
            and time.monotonic() < deadline
        ):
            msg = self._next_msg(deadline)
            if isinstance(msg, NodeStats) and msg.is_final:
                stats[msg.node] = msg
            elif isinstance(msg, NodeFailed):
                self._failed_nodes.add(msg.node)
                is_sched_alive = msg.node != SCHEDULER_NODE
            elif msg is None:
                break
        if is_sched_alive:
            self._sched_q.put(Shutdown())
            while time.monotonic() < deadline:
                msg = self._next_msg(deadline)
                if isinstance(msg, SchedulerStats):
                    self._num_fetches = msg.num_fetches
                    break
                if msg is None:
                    break
        if not is_sched_alive:
            # Nodes whose last message goes to a dead scheduler's full queue cannot exit on
            # their own: give them a moment, then terminate them.
            deadline = min(deadline, time.monotonic() + 2.0)
        for p in [*self._procs, self._scheduler]:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if isinstance(p, mp.process.BaseProcess) and p.is_alive():
                p.terminate()
                p.join(timeout=5)
        readers = [(SCHEDULER_NODE, self._sched_q), *self._inboxes.items()]
        for n, q in readers:
            if n in self._failed_nodes and isinstance(q, mp.queues.Queue):
                # Messages a dead reader never took must not block this process's exit.
                q.cancel_join_thread()
        return [stats[n] for n in sorted(stats)]

    def _next_msg(self, deadline: float) -> Message | None:
        try:
            msg: Message = self._driver_q.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            return None
        return msg

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
