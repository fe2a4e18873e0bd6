"""Figs. 13-14 probe (issue 26): why DualPath scheduling does not lower our storage-NIC Max/Avg.

    python research/snic_balance.py --setup ds660b_2p4d --agents 1024 \
        [--pd 2P4D] [--modes dual-path,dualpath] [--ties pe,de] [--rr-path queue|alternate|random]

One JSON line per (tie side, mode): JCT, the storage-NIC traffic Max/Avg across machines per
10 s window (mean over windows with reads: the simulator's `snic_window_max_over_avg`; weighted
by the bytes of each window; the mean over every three machines), the whole-run bytes Max/Avg,
each machine's mean read rate over the windows with reads, the prefill machines' share of the
bytes, and how the read-path decisions fell: `decisions` (requests with hits whose path was
chosen), `ties` (both nodes' read queues equal when deciding: queued plus in-flight tokens),
`ties_both_empty` (both zero), `pe_side` (read wholly on the PE side).

`--ties` sets `SchedulerParams.dual_tie_side` (now also `dualpath simulate --read-tie-side`).
`--rr-path` changes how the round-robin baseline (`dual-path` mode only) picks a request's read
side: `queue` is the simulator's rule (the shorter read queue, as DualPath); `alternate` (PE,
DE, PE, ... over the run's requests) and `random` (a fair coin, seed 0) read half the requests
on each side without looking at the queues, one reading of the paper's "w/o scheduling" step,
whose text puts the path choice in the inter-engine scheduler (§6.1). (`random` is now also
`SchedulerParams.rr_read_side` / `dualpath simulate --rr-read-side random`, with its own seeded
generator, so its runs differ from this probe's numpy coin in detail.)

It runs the pure-Python simulator (`DUALPATH_PURE_PYTHON=1`, 3-4x slower than the compiled
build; the same results) so that it can wrap `plan_pair_read` where `sched.pe` and `sched.de`
call it; nothing in the simulator changes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import replace

os.environ["DUALPATH_PURE_PYTHON"] = "1"  # before dualpath is imported: wrappable modules

import numpy as np

import dualpath.sched.de as de_mod
import dualpath.sched.pe as pe_mod
from dualpath.plan.runner import RunSpec
from dualpath.plan.setups import setup
from dualpath.sched.cost import coefficients_for
from dualpath.sched.params import SchedulerParams, derive_scheduler_params
from dualpath.sched.path import ReadSideChooser, apply_read_plan, plan_pair_read
from dualpath.sched.types import ReadPlan
from dualpath.sim.result import mean_finite, window_max_over_avg
from dualpath.sim.simulator import simulate

RR_PATHS = ("queue", "alternate", "random")


class PathProbe:
    """Wraps `plan_pair_read`: counts ties and, for `alternate` / `random`, picks the side
    without the queues."""

    def __init__(self) -> None:
        self.how = "queue"
        self.counts: dict[str, int] = {}
        self._turn = 0
        self._rng = np.random.default_rng(0)

    def reset(self, how: str) -> None:
        self.how, self.counts, self._turn = how, {}, 0
        self._rng = np.random.default_rng(0)

    def _add(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def __call__(self, params: SchedulerParams, hit_tokens: int, pe_node: int, de_node: int,
                 decide_q: Mapping[int, int], read_q: MutableMapping[int, int],
                 sides: ReadSideChooser | None = None) -> ReadPlan:
        qp, qd = decide_q.get(pe_node, 0), decide_q.get(de_node, 0)
        if self.how == "queue" or hit_tokens == 0:
            plan = plan_pair_read(params, hit_tokens, pe_node, de_node, decide_q, read_q, sides)
        else:
            blocks = hit_tokens // params.block_size_tokens
            if self.how == "alternate":
                self._turn += 1
                on_pe = self._turn % 2 == 1
            else:
                on_pe = bool(self._rng.random() < 0.5)
            plan = ReadPlan(pe_node, de_node, blocks, blocks if on_pe else 0,
                            params.block_size_tokens)
            apply_read_plan(plan, read_q)
        if hit_tokens > 0:
            self._add("decisions")
            self._add("ties", qp == qd)
            self._add("ties_both_empty", qp == qd == 0)
            self._add("pe_side", plan.num_pe_blocks == plan.num_hit_blocks)
        return plan


PROBE = PathProbe()
pe_mod.plan_pair_read = PROBE  # type: ignore[assignment,attr-defined]
de_mod.plan_pair_read = PROBE  # type: ignore[assignment,attr-defined]


def run(setup_name: str, p: int, d: int, mode: str, agents: int, tie: str,
        rr_path: str) -> dict[str, object]:
    spec = RunSpec(setup_name, mode, agents, "64k", num_prefill_nodes=p, num_decode_nodes=d)
    cfg = spec.config()
    cl = cfg.cluster
    params = derive_scheduler_params(cl.model, cl.hardware,
                                     coefficients_for(cl.model, cl.hardware), dual_tie_side=tie)
    cfg = replace(cfg, scheduler=params)
    how = rr_path if mode == "dual-path" else "queue"
    PROBE.reset(how)
    started = time.perf_counter()
    r = simulate(cfg)
    wall = time.perf_counter() - started
    cap = r.resources["snic_read"].capacity_bytes_per_s * r.utilization_bin_s
    b = np.asarray(r.storage_read_series_by_node, dtype=np.float64) * cap  # machines x windows
    triples = [mean_finite(window_max_over_avg(b[list(t)]))
               for t in itertools.combinations(range(b.shape[0]), 3)]
    busy = b.sum(axis=0) > 0
    per_node = b.sum(axis=1)
    return {
        "setup": setup_name, "pd": f"{cl.num_prefill_nodes}P{cl.num_decode_nodes}D",
        "mode": mode, "rr_path": how, "tie": tie, "agents": agents,
        "jct_s": round(r.jct_s, 1), "wall_s": round(wall, 1),
        "snic_mean": round(r.snic_window_max_over_avg, 3),
        "snic_weighted": round(mean_finite(window_max_over_avg(b), weights=b.sum(axis=0)), 3),
        "snic_triples_mean": round(float(np.mean(triples)), 3) if triples else None,
        "snic_whole_run": round(float(per_node.max() / per_node.mean()), 3),
        "node_GBps_busy_windows":
            (b[:, busy].mean(axis=1) / r.utilization_bin_s / 1e9).round(2).tolist(),
        "snic_cap_GBps": round(r.resources["snic_read"].capacity_bytes_per_s / 1e9, 2),
        "pe_nodes_share": round(float(per_node[:cl.num_prefill_nodes].sum() / per_node.sum()), 3),
        **PROBE.counts,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setup", required=True, help="a plan.setups name")
    ap.add_argument("--pd", default="", help="e.g. 1P2D (default: the setup's)")
    ap.add_argument("--agents", type=int, default=512)
    ap.add_argument("--modes", default="dual-path,dualpath")
    ap.add_argument("--ties", default="pe", help="dual_tie_side values, comma-separated")
    ap.add_argument("--rr-path", default="queue", choices=RR_PATHS)
    a = ap.parse_args()
    s = setup(a.setup)
    p, d = s.num_prefill_nodes, s.num_decode_nodes
    if a.pd:
        p, d = (int(x) for x in a.pd.upper().removesuffix("D").split("P"))
    for tie in a.ties.split(","):
        for mode in a.modes.split(","):
            print(json.dumps(run(a.setup, p, d, mode, a.agents, tie, a.rr_path)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
