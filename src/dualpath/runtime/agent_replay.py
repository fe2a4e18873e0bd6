"""The offline agentic batch driver: agents replayed on a `Cluster`, and what a run returns.

Every agent starts at once; each agent's next turn is submitted when its previous turn is done,
with the context grown by the turn's real output and the next append (so the previous turn's
persisted blocks are the next turn's cache hits).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dualpath.core.errors import SpecError
from dualpath.runtime.emulated_cluster import Cluster, RunError
from dualpath.runtime.messages import NodeStats, TurnDone
from dualpath.runtime.model.sampling import SamplingParams
from dualpath.runtime.run_config import RunConfig
from dualpath.workload.tokens import RandomTokens
from dualpath.workload.trajectory import Trajectory


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


def replay(
    cluster: Cluster,
    agents: Sequence[AgentScript],
    on_turn: Callable[[TurnRecord], object] | None = None,
    timeout_s: float = 600.0,
) -> RunResult:
    """Replay `agents` on `cluster` (all start at once, offline batch) until every turn is done,
    then close it; RunError when no message comes within `timeout_s` or a node failed."""
    cfg = cluster.cfg
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
        rid, hit = cluster.submit(prompt, sampling)
        in_flight[rid] = TurnRecord(
            agent.agent_id, k, rid, len(prompt), hit, (), time.time(), 0.0, 0.0
        )

    started_at = time.time()
    for a in agents:
        submit(a)
    while in_flight:
        msg = cluster.next_message(timeout_s)
        if msg is None:
            raise RunError(f"no message from the cluster within {timeout_s:g} s")
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
    nodes = cluster.close()
    return RunResult(
        cfg, records, nodes, started_at, finished_at, cluster.num_fetches, outputs
    )
