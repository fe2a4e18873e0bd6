"""One scheduler, three worlds: a scripted sequence of arrivals, fetches and completions driven
through the simulator's adapter (`sim.policy.Policy`, applied as the simulator applies it: an
engine's counters change the moment it is bound) and the runtime's (`runtime.scheduler_process.
RuntimeScheduler`, fed by `Fetch` messages whose loads are what each node has received so far)
must make the same decisions: the same PE, DE and read split for every request, at the same
fetch, and the same queue lengths after every fetch. The vLLM router's `RoutePolicy` (one
engine per instance, loads from its own accounting, every decision in one `schedule()`) must
decide as the simulator's adapter driven in that rhythm. And all three derive alpha alike."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from dualpath.core.blocks import block_keys
from dualpath.core.cluster import ClusterSpec
from dualpath.core.errors import SpecError
from dualpath.core.hardware import hardware_preset
from dualpath.core.model import model_preset
from dualpath.integrations.vllm.router.policy import RoutePolicy, route_params
from dualpath.runtime.kvlayout import KVLayout
from dualpath.runtime.messages import EngineLoad, Fetch, TurnSpec
from dualpath.runtime.model.sampling import SamplingParams
from dualpath.runtime.run_config import RunConfig, scheduler_params
from dualpath.runtime.scheduler_process import RuntimeScheduler, SchedulerConfig, Submitted
from dualpath.sched.cost import coefficients_for
from dualpath.sched.params import PathMode, RRReadSide, SchedulerParams, TieSide
from dualpath.sched.types import EngineReport, Role, WaitingRequest
from dualpath.sim import SimConfig, SimParams, Workload, mode_preset
from dualpath.sim.sched_adapter import Policy

P, D, G = 1, 2, 2  # prefill nodes, decode nodes, engines per node
PE_NODES = range(P)
DE_NODES = range(P, P + D)
BS = 64
HBM = 4000  # bytes per decode engine; 1 byte of KV per token: a few requests each


def engines_of(node: int, g: int = G) -> range:
    return range(node * g, node * g + g)


@dataclass
class Engine:
    num_seqs: int = 0
    num_tokens: int = 0
    free_hbm_bytes: int = HBM


@dataclass
class World:
    """One world's engines and read queues, and what its adapter decided per request."""

    g: int = G
    """Engines per node."""
    engines: dict[int, Engine] = field(default_factory=dict)
    read_q: dict[int, int] = field(default_factory=lambda: dict.fromkeys(range(P + D), 0))
    pe_of: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    """request -> (PE engine, PE-side read tokens, DE-side read tokens)."""
    de_of: dict[int, tuple[int, int]] = field(default_factory=dict)
    """request -> (DE engine, reserved HBM bytes)."""

    def __post_init__(self) -> None:
        self.engines = {e: Engine() for e in range((P + D) * self.g)}

    def reports(self, node: int) -> list[EngineReport]:
        role = Role.PREFILL if node in PE_NODES else Role.DECODE
        return [EngineReport(e, node, role, self.engines[e].num_seqs, self.engines[e].num_tokens,
                             self.read_q[node], self.engines[e].free_hbm_bytes)
                for e in engines_of(node, self.g)]

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
        self.read_q[pe_engine // self.g] -= pe_read
        self.read_q[de_engine // self.g] -= de_read


class SimSide:
    """The simulator's adapter, driven the way `sim.handlers.Handlers._dispatch_de/_pe` drive it."""

    def __init__(self, mode: str, params: SchedulerParams, g: int = G) -> None:
        hw, model = hardware_preset("h800-deepseek"), model_preset("ds-27b")
        config = SimConfig(ClusterSpec(hw, model, P, D), Workload.from_lists([[(64, 0, 1)]]),
                           params=SimParams(block_size_tokens=BS), scheduler=params)
        self.policy = Policy(config.with_mode(mode), coefficients_for(model, hw), D)
        self.world = World(g)
        self.waiting: dict[int, WaitingRequest] = {}

    def submit(self, r: WaitingRequest) -> None:
        self.waiting[r.request_id] = r
        self.policy.sched.submit(r)

    def de_fetch(self, node: int) -> None:
        sched, w = self.policy.sched, self.world
        if sched.num_global:
            sched.drain([sum(w.engines[e].num_tokens for e in engines_of(n, w.g))
                         for n in DE_NODES])
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


class RouterSide:
    """The vLLM router's `RoutePolicy` with one engine per instance (prefill instance i is
    engine and node i, decode instance j engine and node P + j), each decode instance holding
    `HBM` bytes of KV; a finished request replied from both its prefill and its decode."""

    def __init__(self, mode: str, params: SchedulerParams) -> None:
        m = mode_preset(mode)
        self.policy = RoutePolicy(params.with_overrides(path_mode=PathMode(m.paths)), P, D,
                                  is_round_robin=m.is_round_robin, decode_kv_capacity_bytes=HBM)

    def submit(self, r: WaitingRequest) -> None:
        self.policy.submit(r.request_id, r.prompt_tokens, r.hit_tokens // BS, r.gen_tokens)

    def schedule(self) -> list[tuple[int, int, int, int]]:
        return [(rt.request_id, rt.prefill, P + rt.decode, rt.plan.num_pe_blocks)
                for rt in self.policy.schedule()]

    def finish(self, rid: int) -> None:
        self.policy.prefill_done(rid)
        self.policy.finished(rid)


def queue_lengths(side: SimSide | RuntimeSide | RouterSide) -> tuple[int, ...]:
    sched = side.sched.sched if isinstance(side, RuntimeSide) else side.policy.sched
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


@pytest.mark.parametrize("mode", ["basic", "dual-path", "dualpath", "split"])
def test_the_router_decides_as_the_simulator_in_its_rhythm(mode: str) -> None:
    """Every decision point is the router's `schedule()`: DE phase 1 and 2 for every decode
    instance, then one PE fetch; the simulator's adapter makes the same calls in that order."""
    params = SchedulerParams(alpha_tokens=300, beta_tokens=2500, kv_bytes_per_token=1.0,
                             block_size_tokens=BS)
    sim, router = SimSide(mode, params, g=1), RouterSide(mode, params)
    rng = random.Random(23)
    next_id = 0
    decisions: list[tuple[int, int, int, int]] = []
    for step in range(80):
        done = sorted(set(sim.world.pe_of) & set(sim.world.de_of))
        for rid in rng.sample(done, k=min(len(done), rng.randint(0, 3))):
            sim.finish(rid)
            router.finish(rid)
        for _ in range(rng.randint(0, 4) if step < 30 else 0):
            prompt = rng.randint(1, 24) * 64 + rng.randint(0, 63)
            r = WaitingRequest(next_id, prompt, rng.randint(0, prompt // BS) * BS,
                               rng.randint(1, 50))
            next_id += 1
            sim.submit(r)
            router.submit(r)
        for node in DE_NODES:
            sim.de_fetch(node)
        got = [d for node in PE_NODES for d in sim.pe_fetch(node)]
        assert router.schedule() == got, f"step {step}"
        assert queue_lengths(router) == queue_lengths(sim), f"step {step}"
        decisions += got
    # The script exercised the policies: requests waited for HBM, then all were placed.
    assert len(decisions) == next_id > 60
    assert len({d[2] for d in decisions}) == D and router.policy.num_waiting == 0


def test_every_world_derives_alpha_by_one_rule() -> None:
    """3 s of one storage NIC's reads, in tokens: the simulator's parameters, the runtime's
    and the router's (from `--storage-gbps`) for the same NIC and KV size."""
    hw, model = hardware_preset("h800-deepseek"), model_preset("ds-27b")
    rate, kv = hw.storage_nic_bytes_per_s, model.kv_bytes_per_token
    want = rate * 3.0 / kv
    sim = SimConfig(ClusterSpec(hw, model, P, D), Workload.from_lists([[(64, 0, 1)]]))
    assert Policy(sim, coefficients_for(model, hw), D).sched.params.alpha_tokens \
        == pytest.approx(want, rel=1e-12)
    layout = KVLayout(num_layers=1, block_size=BS, num_kv_heads=1, head_dim=16)
    run = RunConfig(mode="dualpath", store_root=".", storage_nic_bytes_per_s=rate)
    assert scheduler_params(run, layout).alpha_tokens == pytest.approx(
        rate * 3.0 / layout.kv_bytes_per_token, rel=1e-12)
    routed, _ = route_params("dualpath", BS, kv, storage_gbps=rate * 8 / 1e9)
    assert routed.alpha_tokens == pytest.approx(want, rel=1e-12)


def test_every_world_passes_the_read_side_choices() -> None:
    """`dual_tie_side` and `rr_read_side` (unset: the scheduler's defaults) and the node counts
    the balanced tie rule weighs, in the simulator, the runtime and the router."""
    hw, model = hardware_preset("h800-deepseek"), model_preset("ds-27b")
    coeffs = coefficients_for(model, hw)
    sim = SimConfig(ClusterSpec(hw, model, P, D), Workload.from_lists([[(64, 0, 1)]]),
                    mode=mode_preset("dual-path"),
                    scheduler_overrides=(("dual_tie_side", "pe"), ("rr_read_side", "queue")))
    sched = Policy(sim, coeffs, D).sched
    assert (sched.params.dual_tie_side, sched.params.rr_read_side) == (
        TieSide.PE, RRReadSide.QUEUE)
    assert (sched.sides.num_pe_nodes, sched.sides.num_de_nodes) == (P, D)
    assert not sched.sides.is_queue_blind
    plain = Policy(SimConfig(sim.cluster, sim.workload, mode=mode_preset("dual-path")), coeffs,
                   D).sched
    assert (plain.params.dual_tie_side, plain.params.rr_read_side) == (
        TieSide.BALANCED, RRReadSide.RANDOM)
    assert plain.sides.is_queue_blind
    layout = KVLayout(num_layers=1, block_size=BS, num_kv_heads=1, head_dim=16)
    run = RunConfig(mode="dual-path", store_root=".", read_tie_side="pe",
                    rr_read_side="queue")
    got = scheduler_params(run, layout)
    assert (got.dual_tie_side, got.rr_read_side) == (TieSide.PE, RRReadSide.QUEUE)
    default = scheduler_params(RunConfig(mode="dual-path", store_root="."), layout)
    assert (default.dual_tie_side, default.rr_read_side) == (TieSide.BALANCED, RRReadSide.RANDOM)
    with pytest.raises(SpecError, match="rr_read_side"):
        RunConfig(mode="dual-path", store_root=".", rr_read_side="alternate")
    rt = RuntimeScheduler(SchedulerConfig(got, P, D, G, is_round_robin=True, seed=3))
    assert (rt.sched.sides.num_pe_nodes, rt.sched.sides.num_de_nodes) == (P, D)
    assert not rt.sched.sides.is_queue_blind  # `got` names the queue rule
    router = RoutePolicy(got, 2, 3)
    assert (router.sched.sides.num_pe_nodes, router.sched.sides.num_de_nodes) == (2, 3)
