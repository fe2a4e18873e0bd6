"""One scheduler, two worlds: a scripted sequence of arrivals, fetches and completions driven
through the simulator's adapter (`sim.policy.Policy`, applied as the simulator applies it: an
engine's counters change the moment it is bound) and the runtime's (`runtime.scheduler_process.
RuntimeScheduler`, fed by `Fetch` messages whose loads are what each node has received so far)
must make the same decisions: the same PE, DE and read split for every request, at the same
fetch, and the same queue lengths after every fetch."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from dualpath.core.blocks import block_keys
from dualpath.core.cluster import ClusterSpec
from dualpath.core.hardware import hardware_preset
from dualpath.core.model import model_preset
from dualpath.runtime.messages import EngineLoad, Fetch, TurnSpec
from dualpath.runtime.model.sampling import SamplingParams
from dualpath.runtime.scheduler_process import RuntimeScheduler, SchedulerConfig, Submitted
from dualpath.sched.cost import coefficients_for
from dualpath.sched.params import PathMode, SchedulerParams
from dualpath.sched.types import EngineReport, Role, WaitingRequest
from dualpath.sim import SimConfig, SimParams, Workload, mode_preset
from dualpath.sim.policy import Policy

P, D, G = 1, 2, 2  # prefill nodes, decode nodes, engines per node
PE_NODES = range(P)
DE_NODES = range(P, P + D)
BS = 64
HBM = 4000  # bytes per decode engine; 1 byte of KV per token: a few requests each


def engines_of(node: int) -> range:
    return range(node * G, node * G + G)


@dataclass
class Engine:
    num_seqs: int = 0
    num_tokens: int = 0
    free_hbm_bytes: int = HBM


@dataclass
class World:
    """One world's engines and read queues, and what its adapter decided per request."""

    engines: dict[int, Engine] = field(
        default_factory=lambda: {e: Engine() for e in range((P + D) * G)})
    read_q: dict[int, int] = field(default_factory=lambda: dict.fromkeys(range(P + D), 0))
    pe_of: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    """request -> (PE engine, PE-side read tokens, DE-side read tokens)."""
    de_of: dict[int, tuple[int, int]] = field(default_factory=dict)
    """request -> (DE engine, reserved HBM bytes)."""

    def reports(self, node: int) -> list[EngineReport]:
        role = Role.PREFILL if node in PE_NODES else Role.DECODE
        return [EngineReport(e, node, role, self.engines[e].num_seqs, self.engines[e].num_tokens,
                             self.read_q[node], self.engines[e].free_hbm_bytes)
                for e in engines_of(node)]

    def loads(self, node: int) -> tuple[EngineLoad, ...]:
        return tuple(EngineLoad(r.engine_id, r.num_seqs, r.num_tokens, r.read_q_tokens,
                                r.free_hbm_bytes) for r in self.reports(node))

    def bind_de(self, rid: int, engine: int, hbm: int, charge: int) -> None:
        e = self.engines[engine]
        e.num_seqs, e.num_tokens, e.free_hbm_bytes = (e.num_seqs + 1, e.num_tokens + charge,
                                                      e.free_hbm_bytes - hbm)
        self.de_of[rid] = (engine, hbm)

    def bind_pe(self, rid: int, engine: int, pe_read: int, de_read: int, charge: int) -> None:
        e = self.engines[engine]
        e.num_seqs, e.num_tokens = e.num_seqs + 1, e.num_tokens + charge
        self.pe_of[rid] = (engine, pe_read, de_read)

    def finish(self, r: WaitingRequest) -> None:
        """Prefill, reads and decode of `r` are over: its engines and read queues let go."""
        pe_engine, pe_read, de_read = self.pe_of.pop(r.request_id)
        de_engine, hbm = self.de_of.pop(r.request_id)
        p, d = self.engines[pe_engine], self.engines[de_engine]
        p.num_seqs, p.num_tokens = p.num_seqs - 1, p.num_tokens - r.prompt_tokens
        d.num_seqs, d.num_tokens = d.num_seqs - 1, d.num_tokens - r.prompt_tokens
        d.free_hbm_bytes += hbm
        self.read_q[pe_engine // G] -= pe_read
        self.read_q[de_engine // G] -= de_read


class SimSide:
    """The simulator's adapter, driven the way `Simulator._dispatch_de/_pe` drive it."""

    def __init__(self, mode: str, params: SchedulerParams) -> None:
        hw, model = hardware_preset("h800-deepseek"), model_preset("ds-27b")
        config = SimConfig(ClusterSpec(hw, model, P, D), Workload.from_lists([[(64, 0, 1)]]),
                           params=SimParams(block_size_tokens=BS), scheduler=params)
        self.policy = Policy(config.with_mode(mode), coefficients_for(model, hw), D)
        self.world = World()
        self.waiting: dict[int, WaitingRequest] = {}

    def submit(self, r: WaitingRequest) -> None:
        self.waiting[r.request_id] = r
        self.policy.sched.submit(r)

    def de_fetch(self, node: int) -> None:
        sched, w = self.policy.sched, self.world
        if sched.num_global:
            sched.drain([sum(w.engines[e].num_tokens for e in engines_of(n)) for n in DE_NODES])
        for a in sched.de_fetch(node - P, w.reports(node), None, True).assignments:
            w.bind_de(a.request_id, a.engine_id, a.hbm_bytes,
                      self.policy.de_charge(self.waiting[a.request_id]))

    def pe_fetch(self, node: int) -> list[tuple[int, int, int, int]]:
        w = self.world
        de_read_q = {n: w.read_q[n] for n in DE_NODES}
        out = []
        for a in self.policy.sched.pe_fetch(node, w.reports(node), de_read_q, True).assignments:
            plan = a.read
            assert plan is not None
            w.bind_pe(a.request_id, a.engine_id, plan.pe_read_tokens, plan.de_read_tokens,
                      self.policy.pe_charge(self.waiting[a.request_id]))
            w.read_q[plan.pe_node_id] += plan.pe_read_tokens
            w.read_q[plan.de_node_id] += plan.de_read_tokens
            out.append((a.request_id, a.engine_id, w.de_of[a.request_id][0], plan.num_pe_blocks))
        return out

    def finish(self, rid: int) -> None:
        self.world.finish(self.waiting.pop(rid))


class RuntimeSide:
    """The runtime's adapter, fed `Fetch` messages; a node's counters change when it receives
    a task (the PE in its fetch's reply, the DE in the reply to its next fetch)."""

    def __init__(self, mode: str, params: SchedulerParams) -> None:
        m = mode_preset(mode)
        cfg = SchedulerConfig(params.with_overrides(path_mode=PathMode(m.paths)), P, D, G,
                              is_round_robin=m.is_round_robin)
        self.sched = RuntimeScheduler(cfg)
        self.world = World()
        self.waiting: dict[int, WaitingRequest] = {}

    def submit(self, r: WaitingRequest) -> None:
        self.waiting[r.request_id] = r
        tokens = tuple(range(r.prompt_tokens))
        turn = TurnSpec(tokens, tuple(block_keys(tokens, BS)), r.hit_tokens // BS)
        self.sched.submit(Submitted(r, turn, SamplingParams(max_tokens=r.gen_tokens, seed=0)))

    def de_fetch(self, node: int) -> None:
        w = self.world
        for t in self.sched.on_fetch(Fetch(node, w.loads(node))).decode:
            r = self.waiting[t.request_id]
            w.bind_de(t.request_id, t.de_engine, self.sched.cfg.params.hbm_bytes(r),
                      len(t.turn.token_ids))
            w.read_q[node] += (t.turn.num_hit_blocks - t.num_pe_blocks) * BS

    def pe_fetch(self, node: int) -> list[tuple[int, int, int, int]]:
        w = self.world
        out = []
        for t in self.sched.on_fetch(Fetch(node, w.loads(node))).prefill:
            de_read = (t.turn.num_hit_blocks - t.num_pe_blocks) * BS
            w.bind_pe(t.request_id, t.pe_engine, t.num_pe_blocks * BS, de_read,
                      len(t.turn.token_ids))
            w.read_q[node] += t.num_pe_blocks * BS
            out.append((t.request_id, t.pe_engine, t.de_engine, t.num_pe_blocks))
        return out

    def finish(self, rid: int) -> None:
        self.world.finish(self.waiting.pop(rid))
        self.sched.finished(rid)


def queue_lengths(side: SimSide | RuntimeSide) -> tuple[int, ...]:
    sched = side.policy.sched if isinstance(side, SimSide) else side.sched.sched
    return (sched.num_global, *(sched.num_private(g) for g in range(D)), sched.num_pe_waiting)


@pytest.mark.parametrize("mode", ["basic", "dual-path", "dualpath", "split"])
def test_both_adapters_make_the_same_decisions_for_one_script(mode: str) -> None:
    params = SchedulerParams(alpha_tokens=300, beta_tokens=2500, kv_bytes_per_token=1.0,
                             block_size_tokens=BS)
    sides = (SimSide(mode, params), RuntimeSide(mode, params))
    rng = random.Random(19)
    next_id, num_assigned = 0, 0
    decisions: list[list[tuple[int, int, int, int]]] = [[], []]

    def fetch_de_all() -> None:
        for node in DE_NODES:
            for s in sides:
                s.de_fetch(node)
            assert queue_lengths(sides[0]) == queue_lengths(sides[1])

    for step in range(40):
        # Completions first, then a fresh report from every DE node (the runtime's nodes
        # report what they hold only on their next fetch).
        done = sorted(set(sides[0].world.pe_of) & set(sides[0].world.de_of))
        for rid in rng.sample(done, k=min(len(done), rng.randint(0, 3))):
            for s in sides:
                s.finish(rid)
        fetch_de_all()
        for _ in range(rng.randint(0, 4) if step < 30 else 0):
            prompt = rng.randint(1, 24) * 64 + rng.randint(0, 63)
            r = WaitingRequest(next_id, prompt, rng.randint(0, prompt // BS) * BS,
                               rng.randint(1, 50))
            next_id += 1
            for s in sides:
                s.submit(r)
        fetch_de_all()
        for node in PE_NODES:
            got = [s.pe_fetch(node) for s in sides]
            assert got[0] == got[1], f"step {step}: PE fetch of node {node}"
            num_assigned += len(got[0])
            for k in range(2):
                decisions[k] += got[k]
        fetch_de_all()  # delivers the DE tasks
        fetch_de_all()  # the DE nodes report them
    assert decisions[0] == decisions[1]
    # The script exercised the policies: requests waited, then all were placed, on both sides.
    assert num_assigned == next_id > 60
    assert len({d[1] for d in decisions[0]}) == G and len({d[2] for d in decisions[0]}) == D * G
