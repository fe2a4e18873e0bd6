"""Scheduler throughput at the paper's largest scale: 1,152 engines (144 nodes, 48P96D) and
10,000 waiting requests (DeepSeek-V3.2 on h800-deepseek, derived alpha/beta).

One "round" schedules the whole queue the way both worlds drive the policy (DE-first order):
DE global drain to the 96 DE groups, one DE fetch per group, then PE fetches group after group
over the FIFO queue with read-path choice. Reported: requests fully scheduled (DE + PE + read
path) per CPU second, CPU time per fetch, and ratios against baselines measured in the same
process: the round-robin policies (cheapest possible choice rule) and, for one 384-engine PE
group, a literal O(queue x engines) Algorithm 1.

Run: `.venv/bin/python benchmarks/sim/bench_sched.py` (about 20 s; `--repeats` to change).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from dualpath.core.hardware import hardware_preset
from dualpath.core.model import model_preset
from dualpath.sched.de import (
    de_global_drain,
    de_global_drain_round_robin,
    de_group_fetch,
    de_group_fetch_round_robin,
)
from dualpath.sched.params import PathMode, SchedulerParams, derive_scheduler_params
from dualpath.sched.pe import pe_fetch, pe_fetch_round_robin
from dualpath.sched.types import EngineReport, Role, WaitingRequest

GPUS_PER_NODE = 8
NUM_PREFILL_NODES, NUM_DECODE_NODES = 48, 96
GB = 10**9


@dataclass
class Snapshot:
    queue: list[WaitingRequest]
    pe_groups: list[list[EngineReport]]
    de_groups: list[list[EngineReport]]


def make_snapshot(num_requests: int, p: SchedulerParams, seed: int) -> Snapshot:
    rng = random.Random(seed)
    queue = []
    for i in range(num_requests):
        context = rng.randint(1_000, 64_000)
        append = rng.randint(50, 1_500)
        queue.append(WaitingRequest(i, context + append, context // 64 * 64, rng.randint(20, 400)))
    pe_groups = []
    for n in range(NUM_PREFILL_NODES):
        read_q = rng.randint(0, int(2 * p.alpha_tokens))
        pe_groups.append([
            EngineReport(n * GPUS_PER_NODE + j, n, Role.PREFILL, rng.randint(0, 20),
                         rng.randint(0, int(p.beta_tokens * 0.8)), read_q, 0)
            for j in range(GPUS_PER_NODE)])
    de_groups = []
    for k in range(NUM_DECODE_NODES):
        n = NUM_PREFILL_NODES + k
        read_q = rng.randint(0, int(2 * p.alpha_tokens))
        de_groups.append([
            EngineReport(n * GPUS_PER_NODE + j, n, Role.DECODE, rng.randint(0, 40),
                         rng.randint(0, 2_000_000), read_q, rng.randint(10 * GB, 40 * GB))
            for j in range(GPUS_PER_NODE)])
    return Snapshot(queue, pe_groups, de_groups)


@dataclass
class RoundResult:
    cpu_s: float
    num_scheduled: int
    pe_fetch_s: list[float]
    de_fetch_s: list[float]


def run_round(snap: Snapshot, p: SchedulerParams, round_robin: bool) -> RoundResult:
    """Schedule the whole queue once; CPU time of the policy calls only."""
    clock = time.process_time
    pe_times: list[float] = []
    de_times: list[float] = []
    t0 = clock()
    groups = list(range(len(snap.de_groups)))
    if round_robin:
        drained, _ = de_global_drain_round_robin(snap.queue, groups)
    else:
        loads = {g: sum(r.num_tokens for r in reps) for g, reps in enumerate(snap.de_groups)}
        drained = de_global_drain(snap.queue, loads, p)
    by_id = {r.request_id: r for r in snap.queue}
    private: list[list[WaitingRequest]] = [[] for _ in groups]
    for a in drained:
        private[a.group_id].append(by_id[a.request_id])
    de_node_of: dict[int, int] = {}
    read_q = {reps[0].node_id: reps[0].read_q_tokens for reps in snap.de_groups}
    for g, reps in enumerate(snap.de_groups):
        s = clock()
        if round_robin:
            fetch, _ = de_group_fetch_round_robin(private[g], reps, p)
        else:
            fetch = de_group_fetch(private[g], reps, p)
        de_times.append(clock() - s)
        for d in fetch.assignments:
            de_node_of[d.request_id] = d.node_id
    fifo = deque(r for r in snap.queue if r.request_id in de_node_of)
    num_scheduled = 0
    for reps in snap.pe_groups:
        if not fifo:
            break
        s = clock()
        if round_robin:
            pf, _ = pe_fetch_round_robin(fifo, reps, p, de_node_of=de_node_of,
                                         read_q_tokens_by_node=read_q)
        else:
            pf = pe_fetch(fifo, reps, p, de_node_of=de_node_of, read_q_tokens_by_node=read_q)
        for _ in range(pf.num_assigned):
            fifo.popleft()
        read_q.update(pf.read_q_tokens_by_node)
        pe_times.append(clock() - s)
        num_scheduled += pf.num_assigned
    return RoundResult(clock() - t0, num_scheduled, pe_times, de_times)


def literal_pe_fetch(queue: list[WaitingRequest], reps: list[EngineReport],
                     p: SchedulerParams) -> int:
    """Algorithm 1 re-evaluating every category at every step: O(queue x engines)."""
    tok = {r.engine_id: r.num_tokens for r in reps}
    q = {r.engine_id: r.read_q_tokens for r in reps}
    n = 0
    for r in queue:
        c2 = [e for e in tok if q[e] <= p.alpha_tokens and tok[e] <= p.beta_tokens]
        pool = c2 or [e for e in tok if q[e] > p.alpha_tokens and tok[e] <= p.beta_tokens]
        if not pool:
            break
        e = min(pool, key=lambda x: (tok[x], x))
        tok[e] += p.pe_tok_charge.tokens(r)
        n += 1
    return n


def literal_de_fetch(queue: list[WaitingRequest], reps: list[EngineReport],
                     p: SchedulerParams) -> int:
    """DE phase 2 scanning every engine for every request: O(queue x engines)."""
    seq = {r.engine_id: r.num_seqs for r in reps}
    tok = {r.engine_id: r.num_tokens for r in reps}
    free = {r.engine_id: r.free_hbm_bytes for r in reps}
    total, len_r = sum(free.values()), 0
    for r in queue:
        if p.hbm_bytes(r) > total:
            break
        total -= p.hbm_bytes(r)
        len_r += p.de_tok_charge.tokens(r)
    z = p.z_factor * (len_r + sum(tok.values())) / len(reps)
    n = 0
    for r in queue:
        need, length = p.hbm_bytes(r), p.de_tok_charge.tokens(r)
        fit = [e for e in free if free[e] >= need]
        if not fit:
            break
        low = [e for e in fit if tok[e] + length <= z]
        e = min(low, key=lambda x: (seq[x], x)) if low else min(fit, key=lambda x: (tok[x], x))
        seq[e] += 1
        tok[e] += length
        free[e] -= need
        n += 1
    return n


def median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        s = time.process_time()
        fn()
        times.append(time.process_time() - s)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model, hw = model_preset("deepseek-v3.2"), hardware_preset("h800-deepseek")
    p = derive_scheduler_params(model, hw, path_mode=PathMode.DUAL)
    snap = make_snapshot(args.requests, p, args.seed)
    print(f"cluster: {NUM_PREFILL_NODES}P{NUM_DECODE_NODES}D x {GPUS_PER_NODE} GPUs = "
          f"{(NUM_PREFILL_NODES + NUM_DECODE_NODES) * GPUS_PER_NODE} engines, one node per group; "
          f"{args.requests} waiting requests; alpha={p.alpha_tokens:.3g} beta={p.beta_tokens:.3g}")

    rows = {}
    for name, rr in (("dualpath", False), ("round-robin", True)):
        results = [run_round(snap, p, rr) for _ in range(args.repeats)]
        cpu = statistics.median(r.cpu_s for r in results)
        sched = results[0].num_scheduled
        pe_ms = statistics.median(t for r in results for t in r.pe_fetch_s) * 1e3
        de_ms = statistics.median(t for r in results for t in r.de_fetch_s) * 1e3
        rows[name] = cpu
        print(f"{name:12s} round: {cpu * 1e3:8.1f} ms CPU for {sched} requests -> "
              f"{sched / cpu:10.0f} requests/s (DE+PE+path); median fetch CPU: "
              f"PE {pe_ms:.3f} ms, DE {de_ms:.3f} ms")
    ratio = rows["dualpath"] / rows["round-robin"]
    print(f"ratio dualpath / round-robin CPU per round: {ratio:.2f}")

    # One big PE group (all 48 prefill nodes, 384 engines): heap version vs literal rule.
    big = [r for reps in snap.pe_groups for r in reps]
    sub = snap.queue[:2_000]
    fast = median_time(lambda: pe_fetch(sub, big, p), args.repeats)
    slow = median_time(lambda: literal_pe_fetch(sub, big, p), max(1, args.repeats // 2))
    n = pe_fetch(sub, big, p).num_assigned
    assert n == literal_pe_fetch(sub, big, p)
    print(f"one 384-engine PE group, {len(sub)} queued ({n} assigned): heap "
          f"{fast * 1e3:.2f} ms vs literal {slow * 1e3:.1f} ms CPU -> {slow / fast:.0f}x")

    # One big DE group (all 96 decode nodes, 768 engines): sorted scan vs literal rule.
    big_de = [r for reps in snap.de_groups for r in reps]
    de_s = median_time(lambda: de_group_fetch(snap.queue, big_de, p), args.repeats)
    m = de_group_fetch(snap.queue, big_de, p).num_assigned
    de_fast = median_time(lambda: de_group_fetch(sub, big_de, p), args.repeats)
    de_slow = median_time(lambda: literal_de_fetch(sub, big_de, p), max(1, args.repeats // 2))
    assert de_group_fetch(sub, big_de, p).num_assigned == literal_de_fetch(sub, big_de, p)
    print(f"one 768-engine DE group, {len(snap.queue)} queued ({m} assigned): "
          f"{de_s * 1e3:.1f} ms CPU -> {m / de_s:.0f} requests/s; on {len(sub)} queued: "
          f"{de_fast * 1e3:.1f} ms vs literal {de_slow * 1e3:.1f} ms -> {de_slow / de_fast:.0f}x")

    # Load the paper's scale puts on the scheduler: each PE prefills ~7k new tokens/s of
    # 429-token appends (cost model, V3.2 on H800), i.e. ~16 requests/s per PE.
    need = NUM_PREFILL_NODES * GPUS_PER_NODE * 7_000 / 429
    rate = run_round(snap, p, False)
    snap_rate = rate.num_scheduled / rate.cpu_s
    print(f"required at 48P96D: ~{need:.0f} requests/s -> {need / snap_rate:.3f} of one core")


if __name__ == "__main__":
    main()
