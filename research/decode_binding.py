"""What binds a decode engine in the offline Fig. 9 generation-scaling runs (issue 26): the
sequence cap (`max_seqs_per_decode_engine`), HBM, or the decode step time, and how the
generation trend moves when the cap is lifted or changed.

    python research/decode_binding.py [--gens 1,1.5,2,3] [--modes oracle,dualpath]
        [--caps packaged,0,30] [--scales 1] [--agents 1024] [--mal 64k] [--csv PATH]
    python research/decode_binding.py --objective --scales 1,1.2 --caps packaged,30,0
        [--gens 1,3] [--holds 0,6.5] [--cap-ats assign,decode] [--csv PATH]

`--objective` evaluates, for each (k, cap), the calibration's objective as
`reproduce.calibrate.calibrate_setup` does (Oracle JCTs at its fit cells, log residuals
against Fig. 7, RMS), the held-out 48K cells, and the Oracle generation trend at 64K 1,024
agents (JCT at each `--gens` over that at 1x). Nothing is fitted or written. `--holds` adds
`SimParams.decode_slot_hold_s` values (seconds a turn holds its DE seat and HBM at least,
from its DE assignment; 0: the default); `--cap-ats` `SimParams.decode_cap_at` values (where
the cap holds a turn back: at DE assignment, the default, or at decode admission).

Each point is `RunSpec(setup, mode, agents, mal, gen_factor=G)` with cost overrides
`max_seqs_per_decode_engine=cap` (0: no cap, HBM alone limits) and, for `--scales k`,
`calibrate.scaled_overrides` (every GPU time x k relative to the packaged coefficients). The
decode-engine occupancy is rebuilt from the per-request records: a request holds a sequence
slot and `hbm_bytes = ceil((prompt + gen) x KV bytes per token)` of its DE's KV room from
`de_assigned_s` to `done_s`, as `sim.handlers` charges it. Columns:

- `wait_s`: mean arrival-to-DE-assignment ("allocation") wait per turn;
- `at_cap`: share of DE-time (engines x run time) an engine held `cap` sequences;
- `hbm_full`: share of DE-time an engine's free KV room was below the need of the turn that
  then headed the allocation queue (the oldest waiting turn), while it was under the cap;
- `blocked_cap` / `blocked_hbm`: over the time some turn waited for a DE, the mean share of
  engines that could not take the oldest waiter for the cap / for HBM (under the cap);
- `seqs`: time-mean sequences per DE; `hbm_use`: time-mean share of the KV room in use;
- `tpot_ms`, `decoding`: mean TPOT, and the time-mean sequences decoding per DE
  (`decode_join_s` to `done_s`);
- `turns`, `gen_mtok`: turns of the run, and the tokens they generated (millions);
- `last_turns`, `last_alloc_s`, `last_decode_s`: the agent that finished last (its finish is
  the JCT): its turns, and the seconds it spent waiting for a DE and decoding, summed.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from dualpath.plan.runner import RunSpec, _simulate
from dualpath.plan.setups import HARDWARE, setup
from dualpath.reproduce.calibrate import CALIBRATION_CELLS, HOLDOUT_CELLS, rms_of, scaled_overrides
from dualpath.reproduce.paper import fig7_point
from dualpath.sched import cost as costmod
from dualpath.sched.cost import CostCoefficients
from dualpath.sim import SimResult, simulate

SETUP = "ds660b_2p4d"


def occupancy(result: SimResult, cap: int, kv_room_bytes: float, kv_bpt: float,
              first_engine: int, num_engines: int) -> dict[str, float]:
    """The occupancy columns of the module docstring, from `result`'s records (decode engines
    are ids `first_engine ..` `first_engine + num_engines - 1`)."""
    de = result.col("de_engine").astype(np.int64) - first_engine
    arr, asg = result.col("arrive_s"), result.col("de_assigned_s")
    join, done = result.col("decode_join_s"), result.col("done_s")
    need = np.ceil((result.col("prompt_tokens") + result.col("gen_tokens")) * kv_bpt)
    ok = (asg >= 0) & (done >= 0)
    jct = result.jct_s
    # Events: (time, kind, request); kinds in the order applied at one instant: releases (0),
    # then assignments (1), then arrivals (2) (an arrival at t that is assigned at t never
    # waits).
    times = np.concatenate([done[ok], asg[ok], arr[ok]])
    kinds = np.concatenate([np.zeros(ok.sum()), np.ones(ok.sum()), np.full(ok.sum(), 2)])
    rids = np.concatenate([np.flatnonzero(ok)] * 3)
    order = np.lexsort((kinds, times))
    seqs = np.zeros(num_engines, dtype=np.int64)
    used = np.zeros(num_engines)
    waiting: dict[int, None] = {}  # insertion (arrival) order: the first key is the oldest
    t_prev = 0.0
    at_cap = hbm_full = blk_cap = blk_hbm = wait_time = seq_int = hbm_int = 0.0
    for i in order:
        t = float(times[i])
        dt = t - t_prev
        if dt > 0:
            full = (seqs >= cap) if cap > 0 else np.zeros(num_engines, dtype=bool)
            at_cap += dt * float(full.mean())
            seq_int += dt * float(seqs.mean())
            hbm_int += dt * float(used.mean()) / kv_room_bytes
            if waiting:
                head = need[next(iter(waiting))]
                short = (kv_room_bytes - used < head) & ~full
                hbm_full += dt * float(short.mean())
                wait_time += dt
                blk_cap += dt * float(full.mean())
                blk_hbm += dt * float(short.mean())
            t_prev = t
        r = int(rids[i])
        k = int(kinds[i])
        e = int(de[r])
        if k == 0:
            seqs[e] -= 1
            used[e] -= need[r]
        elif k == 1:
            seqs[e] += 1
            used[e] += need[r]
            waiting.pop(r, None)
        elif asg[r] > t:
            waiting[r] = None
    agent = result.col("agent")
    last = agent == agent[int(np.argmax(done))]
    decoding = np.clip(np.minimum(done, jct) - np.maximum(join, 0.0), 0.0, None)[ok & (join >= 0)]
    return {
        "wait_s": float(np.mean(asg[ok] - arr[ok])),
        "at_cap": at_cap / jct,
        "hbm_full": hbm_full / jct,
        "blocked_cap": blk_cap / wait_time if wait_time else 0.0,
        "blocked_hbm": blk_hbm / wait_time if wait_time else 0.0,
        "wait_time_share": wait_time / jct,
        "seqs": seq_int / jct,
        "hbm_use": hbm_int / jct,
        "decoding": float(decoding.sum()) / (num_engines * jct),
        "turns": float(len(done)),
        "gen_mtok": float(result.col("gen_tokens").sum()) / 1e6,
        "last_turns": float(last.sum()),
        "last_alloc_s": float(np.sum((asg - arr)[last])),
        "last_decode_s": float(np.sum((done - join)[last])),
    }


def overrides(base: CostCoefficients, k: float, cap: int, prefill_k: float = 1.0,
              attention_k: float = 1.0) -> tuple[tuple[str, float], ...]:
    """Cost overrides: every GPU time x `k` (`calibrate.scaled_overrides`), the sequence cap,
    prefill's compute (attention and linear efficiencies) a further `prefill_k` slower, and
    attention (scores and DSA indexer) a further `attention_k` slower; decode steps stay
    memory bound, so these leave them (almost) alone."""
    ov = dict(scaled_overrides(base, k, None, cap) if k != 1.0
              else (("max_seqs_per_decode_engine", cap),))
    for name, slow in (("attention_efficiency", prefill_k * attention_k),
                       ("linear_efficiency", prefill_k)):
        if slow != 1.0:
            ov[name] = min(1.0, float(ov.get(name, getattr(base, name))) / slow)
    return tuple(ov.items())


def _jct(spec: RunSpec, hold: float, cap_at: str = "assign") -> float:
    """The run's JCT with `SimParams.decode_slot_hold_s = hold` and `decode_cap_at = cap_at`
    (0 and assign, the defaults: `_simulate`'s run)."""
    if hold == 0.0 and cap_at == "assign":
        return _simulate(spec)[0].jct_s
    cfg = spec.config()
    return simulate(replace(cfg, params=replace(cfg.params, decode_slot_hold_s=hold,
                                                decode_cap_at=cap_at))).jct_s


def objective(setup_name: str, scales: list[float], caps: list[str], gens: list[float],
              csv_path: Path | None, prefill_scales: list[float],
              attention_scales: list[float], holds: tuple[float, ...] = (0.0,),
              cap_ats: tuple[str, ...] = ("assign",)) -> None:
    """The calibration objective and the generation trend at each (k, cap, prefill k); see
    module doc."""
    base = costmod.load_cost_coefficients(setup(setup_name).model, HARDWARE)
    fit = CALIBRATION_CELLS[setup_name]
    cols = ["k", "prefill_k", "attention_k", "cap", "hold_s", "cap_at", "rms_fit", "rms_48k",
            *(f"{a}@{m}" for a, m in (*fit, *HOLDOUT_CELLS)), *(f"gen{g:g}" for g in gens),
            "1024@64k_s"]
    print(" | ".join(cols))
    rows = []
    for k, cap_s, pk, ak, hold, at in ((k, c, p, a, h, t) for k in scales for c in caps
                                       for p in prefill_scales for a in attention_scales
                                       for h in holds for t in cap_ats):
        cap = base.max_seqs_per_decode_engine if cap_s == "packaged" else int(cap_s)
        ov = overrides(base, k, cap, pk, ak)
        res: dict[str, float] = {}
        logs: dict[str, list[float]] = {"fit": [], "48k": []}
        for a, m in (*fit, *HOLDOUT_CELLS):
            p = fig7_point(setup_name, a, m)
            assert p is not None
            jct = _jct(RunSpec(setup_name, "oracle", a, m, cost_overrides=ov), hold, at)
            res[f"{a}@{m}"] = jct / p.jct_s["oracle"] - 1.0
            logs["fit" if (a, m) in fit else "48k"].append(math.log(jct / p.jct_s["oracle"]))
        g1 = _jct(RunSpec(setup_name, "oracle", 1024, "64k", cost_overrides=ov), hold, at)
        for g in gens:
            jg = _jct(RunSpec(setup_name, "oracle", 1024, "64k", gen_factor=g,
                              cost_overrides=ov), hold, at) if g != 1.0 else g1
            res[f"gen{g:g}"] = jg / g1
        res["1024@64k_s"] = g1
        row = {"k": k, "prefill_k": pk, "attention_k": ak, "cap": cap, "hold_s": hold,
               "cap_at": at,
               "rms_fit": rms_of(logs["fit"]), "rms_48k": rms_of(logs["48k"]), **res}
        rows.append(row)
        print(" | ".join(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c])
                         for c in cols), flush=True)
    if csv_path:
        with csv_path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gens", default="1,1.5,2,3")
    ap.add_argument("--modes", default="oracle,dualpath")
    ap.add_argument("--caps", default="packaged,0",
                    help="comma-separated caps: packaged (the cost file's), 0 (none), N")
    ap.add_argument("--scales", default="1",
                    help="comma-separated GPU-time factors k relative to the packaged values")
    ap.add_argument("--prefill-scales", default="1",
                    help="--objective: comma-separated further slow-downs of prefill compute")
    ap.add_argument("--attention-scales", default="1",
                    help="--objective: comma-separated further slow-downs of attention alone")
    ap.add_argument("--holds", default="0",
                    help="--objective: comma-separated SimParams.decode_slot_hold_s values (s)")
    ap.add_argument("--cap-ats", default="assign",
                    help="--objective: comma-separated SimParams.decode_cap_at values "
                    "(assign: the default; decode: the cap counted at decode admission)")
    ap.add_argument("--agents", type=int, default=1024)
    ap.add_argument("--mal", default="64k")
    ap.add_argument("--setup", default=SETUP)
    ap.add_argument("--csv", type=Path)
    ap.add_argument("--objective", action="store_true",
                    help="the calibration objective and gen trend per (k, cap); see above")
    args = ap.parse_args()
    if args.objective:
        objective(args.setup, [float(v) for v in args.scales.split(",")],
                  args.caps.split(","), [float(v) for v in args.gens.split(",")], args.csv,
                  [float(v) for v in args.prefill_scales.split(",")],
                  [float(v) for v in args.attention_scales.split(",")],
                  tuple(float(v) for v in args.holds.split(",")),
                  tuple(args.cap_ats.split(",")))
        return 0
    s = setup(args.setup)
    base = costmod.load_cost_coefficients(s.model, HARDWARE)
    cols = ["mode", "k", "cap", "gen", "jct_s", "ratio_to_g1", "tpot_ms", "wait_s", "at_cap",
            "hbm_full", "blocked_cap", "blocked_hbm", "wait_time_share", "seqs", "hbm_use",
            "decoding", "turns", "gen_mtok", "last_turns", "last_alloc_s", "last_decode_s"]
    rows: list[dict[str, object]] = []
    print(" | ".join(cols))
    for mode in args.modes.split(","):
        for k in (float(v) for v in args.scales.split(",")):
            for cap_s in args.caps.split(","):
                cap = base.max_seqs_per_decode_engine if cap_s == "packaged" else int(cap_s)
                ov = overrides(base, k, cap)
                coeffs = replace(base, **dict(ov))  # type: ignore[arg-type]
                g1 = math.nan
                for g in (float(v) for v in args.gens.split(",")):
                    spec = RunSpec(args.setup, mode, args.agents, args.mal, gen_factor=g,
                                   cost_overrides=ov)
                    result, _ = _simulate(spec)
                    cl = spec.config().cluster
                    n_de = cl.num_decode_nodes * cl.hardware.gpus_per_node
                    room = costmod.kv_room_bytes(cl.model, cl.hardware,
                                                 coeffs.hbm_reserve_fraction, n_de)
                    occ = occupancy(result, cap, room, cl.model.kv_bytes_per_token,
                                    cl.num_prefill_engines, n_de)
                    if g == 1.0:
                        g1 = result.jct_s
                    row: dict[str, object] = {
                        "mode": mode, "k": k, "cap": cap, "gen": g, "jct_s": result.jct_s,
                        "ratio_to_g1": result.jct_s / g1,
                        "tpot_ms": 1e3 * float(np.mean(result.tpot_s)), **occ}
                    rows.append(row)
                    print(" | ".join(f"{row[c]:.3g}" if isinstance(row[c], float)
                                     else str(row[c]) for c in cols), flush=True)
    if args.csv:
        with args.csv.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
