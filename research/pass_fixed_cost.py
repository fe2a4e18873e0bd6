"""Fig. 3's prefill batching shape in the cost model, as a probe (issue 26): does a prefill pass
whose fixed cost is what the paper's Fig. 3 implies change the held-out trends?

    python research/pass_fixed_cost.py --jobs 2 [--setup ds660b_2p4d] [--x 2.7 |
        --prefill-scale S]
        [--sets fig7,fig8,fig9,fig12] [--storage-read calibrated|queued[:C]|...] [--log RUNS.jsonl]

The paper's Fig. 3 (right: relative token throughput of one prefill pass of b requests, each
30K cached + 300 appended tokens) implies a pass's fixed cost F about 2.7 times one request's
work v (`reproduce.checks.fit_fixed_over_var`); our packaged cost model has F/v = 0.20 for
DeepSeek-V3.2 and 0.67 for DS 27B (section `fig3`). The probe:

1. adds to `per_step_overhead_s` what makes one engine's pass at Fig. 3's point have
   F/v = `--x` (default: the paper's curve), leaving every per-token and per-request term;
2. refits the calibration's two parameters (every GPU time x k, the decode sequence cap) on
   the same Fig. 7 Oracle cells as the packaged fit (`calibrate.calibrate_setup`), so the
   shape, not the scale, is what changes;
3. runs the held-out sets under the packaged and the probe coefficients: Fig. 7 (every mode,
   512-2,048 agents, 32-64K; errors against the paper's values), Fig. 8 (DS 27B's P/D grid,
   Basic and DualPath: the mean and largest speedup, DualPath 2P1D over 1P2D), Fig. 9 (1,024
   agents, 64K,
   append and generation scales 1-3x: the paper says DualPath and Oracle change only slightly
   with the append scale and its speedup stays 1.82-1.99x) and the Fig. 12 ablation (1,024 and
   2,048 agents: +layerwise -17.21%).

`--prefill-scale S` replaces step 1: every per-token prefill cost S times longer, the fixed
costs as packaged (the Fig. 9 addendum's `fig9_work_mix.py` reads the paper's trends as a
loaded Oracle about twice as prefill-weighted as ours); steps 2 and 3 as above.

Nothing is written to the packaged data. Storage reads stay at the packaged (flat) rate; the
storage fit (DS 27B Basic) is not redone, so `--setup ds27b_1p1d` moves the fitted cells too
and its Basic errors say how far.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, replace

from dualpath.core.read_rate import parse_storage_read
from dualpath.plan.runner import Runner, RunSpec, run_storage
from dualpath.plan.setups import HARDWARE, setup
from dualpath.reproduce.ablation import ABLATION, PAPER_ABLATION_REDUCTION
from dualpath.reproduce.calibrate import CALIBRATION_CELLS, calibrate_setup, scaled_overrides
from dualpath.reproduce.checks import APPEND_TOKENS, CONTEXT_TOKENS, PAPER_FIG3, fit_fixed_over_var
from dualpath.reproduce.offline import FIG9_FACTORS
from dualpath.reproduce.paper import SYSTEMS, fig7_point
from dualpath.sched import cost as costmod
from dualpath.sched.cost import CostCoefficients, load_cost_coefficients
from dualpath.sim import SimResult

SETS = ("fig7", "fig8", "fig9", "fig12")
Overrides = tuple[tuple[str, float], ...]


def fixed_over_var(name: str, c: CostCoefficients) -> tuple[float, float]:
    """(F, v) of one engine's prefill pass at Fig. 3's point under coefficients `c`."""
    cl = setup(name).cluster()
    pair = (float(CONTEXT_TOKENS), float(APPEND_TOKENS))
    t1 = costmod.prefill_step_time_s(cl.model, cl.hardware, [pair], c)
    t2 = costmod.prefill_step_time_s(cl.model, cl.hardware, [pair, pair], c)
    return t1 - (t2 - t1), t2 - t1


def probe_base(name: str, x: float) -> CostCoefficients:
    """The packaged coefficients with the per-pass fixed cost raised to F = x v."""
    base = load_cost_coefficients(setup(name).model, HARDWARE)
    f0, v = fixed_over_var(name, base)
    if x * v <= f0:
        raise SystemExit(f"--x {x}: at or below the packaged F/v {f0 / v:.2f}; nothing to add")
    return replace(base, per_step_overhead_s=base.per_step_overhead_s + x * v - f0)


def heavier_prefill_base(name: str, scale: float) -> CostCoefficients:
    """The packaged coefficients with every per-token prefill cost (attention and GEMMs)
    `scale` times longer; fixed overheads and decode's HBM reads as they are (a decode step's
    compute floor uses the linear efficiency too, which this slows alike)."""
    base = load_cost_coefficients(setup(name).model, HARDWARE)
    return replace(base, attention_efficiency=base.attention_efficiency / scale,
                   linear_efficiency=base.linear_efficiency / scale)


def cells(name: str, sets: list[str]) -> list[tuple[str, dict[str, object]]]:
    """(set, RunSpec fields without cost overrides) of every cell the probe compares."""
    out: list[tuple[str, dict[str, object]]] = []
    for s in sets:
        if s == "fig7":
            out += [("fig7", {"mode": m, "num_agents": n, "mal": mal})
                    for mal in ("32k", "48k", "64k") for n in (512, 1024, 2048) for m in SYSTEMS]
        elif s == "fig8":
            out += [("fig8", {"mode": m, "num_agents": n, "mal": mal, "num_prefill_nodes": p,
                              "num_decode_nodes": d})
                    for mal in ("32k", "48k", "64k") for n in (512, 1024, 2048)
                    for p, d in ((1, 1), (2, 1), (1, 2)) for m in ("basic", "dualpath")]
        elif s == "fig9":
            out += [("fig9", {"mode": m, "num_agents": 1024, "mal": "64k", kind: f})
                    for kind in ("append_factor", "gen_factor") for f in FIG9_FACTORS
                    for m in SYSTEMS]
        elif s == "fig12":
            out += [("fig12", {"mode": m, "num_agents": n, "mal": "64k"})
                    for n in (1024, 2048) for m in ABLATION]
        else:
            raise SystemExit(f"--sets: {s!r}: must be one of {', '.join(SETS)}")
    return [(s, {"setup": name, **kw}) for s, kw in out]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--setup", default="ds660b_2p4d", choices=tuple(CALIBRATION_CELLS))
    ap.add_argument("--x", type=float, default=0.0,
                    help="F/v to give the pass (default: the paper's Fig. 3 curve, fitted)")
    ap.add_argument("--prefill-scale", type=float, default=0.0,
                    help="instead of --x: every per-token prefill cost this many times longer "
                    "(then the same refit), the shape the Fig. 9 trends point to")
    ap.add_argument("--storage-read", default="calibrated",
                    help="both forms' storage read model, as `dualpath simulate --storage-read` "
                    "(default: the packaged record)")
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--log", default="", help="append each finished run (JSON lines)")
    args = ap.parse_args()
    name = args.setup
    x = args.x or fit_fixed_over_var(PAPER_FIG3)
    packaged = load_cost_coefficients(setup(name).model, HARDWARE)
    base = (heavier_prefill_base(name, args.prefill_scale) if args.prefill_scale > 0
            else probe_base(name, x))
    f0, v = fixed_over_var(name, packaged)
    f1, v1 = fixed_over_var(name, base)
    print(f"{name}: one engine's pass at {CONTEXT_TOKENS:,} + {APPEND_TOKENS}: v = "
          f"{v * 1e3:.1f} ms per request, F = {f0 * 1e3:.1f} ms packaged (F/v {f0 / v:.2f}) -> "
          f"v {v1 * 1e3:.1f} ms, F {f1 * 1e3:.1f} ms (F/v {f1 / v1:.2f})")
    runner = Runner(jobs=args.jobs, progress=True)
    if args.log:
        log_fh = open(args.log, "a")  # noqa: SIM115 (open for the whole run)

        def on_run(spec: RunSpec, res: SimResult, wall: float) -> None:
            log_fh.write(json.dumps({"spec": asdict(spec), "jct_s": res.jct_s,
                                     "wall_s": wall}) + "\n")
            log_fh.flush()

        runner.on_run = on_run
    started = time.perf_counter()
    cal = calibrate_setup(runner, name, CALIBRATION_CELLS[name], base=base, num_iters=3)
    print(f"refit: gpu_time_scale {cal.gpu_time_scale:.3f}, cap {cal.max_seqs_per_decode_engine}"
          f" (packaged cap {packaged.max_seqs_per_decode_engine}); RMS log residual "
          f"{cal.rms_log_before:.3f} -> {cal.rms_log_after:.3f} ({cal.num_evals} evaluations, "
          f"{time.perf_counter() - started:.0f} s)", flush=True)
    for c in cal.cells:
        print(f"  {c.agents:>5} {c.mal}: paper {c.paper_s:,.0f} s, probe {c.after_s:,.0f} s "
              f"({100 * c.residual:+.1f}%)")
    f2, v2 = fixed_over_var(name, cal.fitted)
    clipped = [n for n in ("attention_efficiency", "linear_efficiency", "decode_hbm_efficiency")
               if getattr(cal.fitted, n) >= 1.0]
    print(f"after the refit: F = {f2 * 1e3:.1f} ms, v = {v2 * 1e3:.1f} ms (F/v {f2 / v2:.2f}); "
          f"at peak (efficiency clipped to 1): {', '.join(clipped) or 'none'}")
    probe: Overrides = scaled_overrides(base, cal.gpu_time_scale, base.hbm_reserve_fraction,
                                        cal.max_seqs_per_decode_engine)
    todo = cells(name, args.sets.split(","))
    forms: dict[str, Overrides] = {"packaged": (), "probe": probe}
    chosen = parse_storage_read(args.storage_read)
    storage = run_storage(chosen, name) if chosen is not None else None
    specs = {(i, f): RunSpec(**kw, cost_overrides=ov, storage=storage)  # type: ignore[arg-type]
             for i, (_, kw) in enumerate(todo) for f, ov in forms.items()}
    runner.prefetch(specs.values())
    print(f"{len(runner.log)} runs, {time.perf_counter() - started:.0f} s wall", file=sys.stderr)
    jct = {(i, f): runner.run(sp).jct_s for (i, f), sp in specs.items()}
    report(name, todo, jct)
    return 0


def report(name: str, todo: list[tuple[str, dict[str, object]]],
           jct: dict[tuple[int, str], float]) -> None:
    """The tables: JCTs under both, their errors where the paper has a value, and the claims."""
    by: dict[tuple[str, str, float, int, str, str], dict[str, float]] = {}
    print("\n| set | variant | agents | MAL | mode | packaged s | probe s | paper s | "
          "packaged err | probe err |\n|---|---|---|---|---|---|---|---|---|---|")
    errs: dict[tuple[str, str], list[float]] = {}
    for i, (s, kw) in enumerate(todo):
        kind = ("append" if "append_factor" in kw else "gen" if "gen_factor" in kw else
                f"{kw['num_prefill_nodes']}P{kw['num_decode_nodes']}D"
                if "num_prefill_nodes" in kw else "")
        f = float(str(kw.get("append_factor", kw.get("gen_factor", 1.0))))
        n, mal, m = int(str(kw["num_agents"])), str(kw["mal"]), str(kw["mode"])
        a, b = jct[(i, "packaged")], jct[(i, "probe")]
        by[(s, kind, f, n, mal, m)] = {"packaged": a, "probe": b}
        p = fig7_point(name, n, mal) if s == "fig7" else None
        paper = p.jct_s.get(m) if p is not None else None
        cols = ["", "", ""]
        if paper:
            cols = [f"{paper:,.0f}", f"{100 * (a / paper - 1):+.1f}%",
                    f"{100 * (b / paper - 1):+.1f}%"]
            for form, val in (("packaged", a), ("probe", b)):
                errs.setdefault((m, form), []).append(abs(val / paper - 1))
        variant = f"{kind} x{f:g}" if kind in ("append", "gen") else kind
        print(f"| {s} | {variant} | {n} | {mal} | {m} | {a:,.0f} | {b:,.0f} | " + " | ".join(cols)
              + " |")
    print()
    for (m, form), v in sorted(errs.items()):
        print(f"Fig. 7 {m} {form}: mean |JCT error| {100 * sum(v) / len(v):.1f}% over {len(v)}")
    for form in ("packaged", "probe"):
        pts = [(n, mal) for mal in ("32k", "48k", "64k") for n in (512, 1024, 2048)
               if ("fig8", "1P2D", 1.0, n, mal, "dualpath") in by]
        if pts:
            def j(pd: str, n: int, mal: str, m: str, form: str = form) -> float:
                return by[("fig8", pd, 1.0, n, mal, m)][form]
            sp = [j(pd, n, mal, "basic") / j(pd, n, mal, "dualpath")
                  for pd in ("1P1D", "2P1D", "1P2D") for n, mal in pts]
            pair = [j("2P1D", n, mal, "dualpath") / j("1P2D", n, mal, "dualpath") for n, mal in pts]
            print(f"Fig. 8 {form}: DualPath/Basic mean {sum(sp) / len(sp):.2f}x, max "
                  f"{max(sp):.2f}x (paper 1.64x, 2.46x); DualPath 2P1D / 1P2D JCT "
                  f"{sum(pair) / len(pair):.2f} (paper ~1)")
        for kind in ("append", "gen"):
            rows = [by.get(("fig9", kind, f, 1024, "64k", m)) for f in FIG9_FACTORS
                    for m in SYSTEMS]
            if any(r is None for r in rows):
                continue
            got = {m: [by[("fig9", kind, f, 1024, "64k", m)][form] for f in FIG9_FACTORS]
                   for m in SYSTEMS}
            trend = ", ".join(f"{m} " + "/".join(f"{j / got[m][0]:.2f}" for j in got[m])
                              for m in SYSTEMS)
            speed = "/".join(f"{bb / d:.2f}" for bb, d in zip(got["basic"], got["dualpath"],
                                                                strict=True))
            print(f"Fig. 9 {kind} {form}: JCT over 1x at {FIG9_FACTORS}: {trend}; "
                  f"DualPath/Basic {speed}")
        red = {}
        for m in ABLATION[1:]:
            vals = [1 - by[("fig12", "", 1.0, n, "64k", m)][form]
                    / by[("fig12", "", 1.0, n, "64k", "basic")][form] for n in (1024, 2048)
                    if ("fig12", "", 1.0, n, "64k", m) in by]
            if vals:
                red[m] = 100 * sum(vals) / len(vals)
        if red:
            print(f"Fig. 12 {form}: " + ", ".join(
                f"{m} {v:.1f}% (paper {PAPER_ABLATION_REDUCTION[m]:.2f}%)" for m, v in red.items()))
    if not math.isfinite(sum(jct.values())):
        raise SystemExit("a run did not finish")


if __name__ == "__main__":
    raise SystemExit(main())
