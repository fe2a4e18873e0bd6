"""`dualpath reproduce`: run the paper's experiments in the simulator; write CSV, PNG, markdown."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from dualpath.cli.common import out_dir
from dualpath.core.errors import DualPathError
from dualpath.plan.ray_backend import RAY_HELP, join
from dualpath.plan.runner import Runner, RunSpec
from dualpath.plan.section import Context, section_markdown
from dualpath.reproduce.calibrate import (
    CALIBRATION_CELLS,
    FIT_RECORD,
    calibrate_setup,
    calibration_to_json,
    write_fitted,
)
from dualpath.reproduce.registry import (
    ALIASES,
    EXPERIMENTS,
    assemble_report,
    resolve,
    run_experiments,
)
from dualpath.reproduce.storage_fit import (
    STORAGE_RECORD,
    calibrate_storage,
    fits_to_json,
    write_fit,
)
from dualpath.sim import SimResult

REPORT_NAME = "README.md"
"""The assembled report's name in --out (a folder on GitHub shows its README)."""


class ReproduceArgsError(DualPathError, ValueError):
    """A bad combination of `dualpath reproduce` options."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "reproduce",
        help="reproduce the paper's figures and tables with the simulator",
        description=(
            "Run the paper's experiments in the simulator and write CSV, PNG and a markdown "
            "section per experiment into --out; `all` also writes the full report. "
            f"Experiments: {', '.join(EXPERIMENTS)} (aliases: {', '.join(ALIASES)}), all; "
            "`calibrate` fits the cost coefficients to the paper's Fig. 7 Oracle JCTs; "
            "`calibrate-storage` fits the storage read rate to DS 27B 1P1D Basic (32K, 64K); "
            "`report` rebuilds the report from the sections an earlier run left in --out."
        ),
    )
    p.add_argument("experiments", nargs="+", metavar="EXPERIMENT",
                   help="experiment names, `all`, `calibrate`, `calibrate-storage` or `report`")
    p.add_argument("--quick", action="store_true",
                   help="scaled-down runs, same shapes (all of them in under 10 minutes)")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for CSV, PNG and markdown sections (default: "
                   "$DUALPATH_OUT/reproduce, else out/reproduce); the committed report is "
                   "rebuilt with `--out docs/reproduction`")
    p.add_argument("--report", type=Path, metavar="PATH",
                   help="write the assembled report here (default for `all` and `report`: "
                   "README.md in --out)")
    p.add_argument("--agents", metavar="N,N", help="override agent counts (offline experiments)")
    p.add_argument("--mal", metavar="32k,64k", help="override MAL columns")
    p.add_argument("--setups", metavar="NAME,NAME",
                   help="override setups: ds660b_2p4d, ds27b_1p1d, qwen32b_1p2d")
    p.add_argument("--online-duration", type=float, default=0.0, metavar="S",
                   help="simulated seconds per online run (default: 600 quick, 7,200 full)")
    p.add_argument("--scale-out", type=int, default=0, metavar="K",
                   help="table3: the large cluster is K times 2P4D with K times the load "
                   "(default: 2 quick, 4 full; the paper's offline run is 24: 48P96D, with "
                   "--agents 2048)")
    p.add_argument("--write", action="store_true",
                   help="calibrate, calibrate-storage: store the fit in the packaged data file")
    p.add_argument("--jobs", type=int, default=0, metavar="N",
                   help="independent simulations run in N processes (default: the machine's "
                   "cores); results are identical to a serial run")
    p.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS", help=RAY_HELP)
    p.add_argument("--start-cap", type=int, default=0, metavar="N",
                   help="calibrate: start the sequence-cap fit at N per decode engine "
                   "(default: the packaged cap, else 32)")
    p.add_argument("--quiet", action="store_true", help="no per-run progress lines")
    p.set_defaults(func=run)


def default_out() -> Path:
    """`$DUALPATH_OUT/reproduce`, else `out/reproduce`: never a tracked folder."""
    return out_dir("reproduce")


def _csv(text: str | None) -> tuple[str, ...]:
    return tuple(t.strip() for t in (text or "").split(",") if t.strip())


def _logger(quiet: bool) -> Runner:
    runner = Runner(progress=not quiet)

    def on_run(spec: RunSpec, res: SimResult, wall: float) -> None:
        if not quiet:
            what = f"{spec.aps:g} APS" if spec.is_online else f"{spec.num_agents} agents"
            pd = (f" {spec.num_prefill_nodes}P{spec.num_decode_nodes}D"
                  if spec.num_prefill_nodes else "")
            node = runner.node_of.get(spec)
            print(f"  {spec.setup}{pd} {spec.mode:<9} {what:>11} {spec.mal}: "
                  f"JCT {res.jct_s:,.0f} s, {res.num_completed} turns, {wall:.1f} s wall"
                  + (f" on {node}" if node else ""), file=sys.stderr, flush=True)

    runner.on_run = on_run
    return runner


def _calibrate(args: argparse.Namespace, ctx: Context) -> int:
    if args.start_cap < 0:
        raise ReproduceArgsError(f"--start-cap={args.start_cap}: must be >= 1 "
                                 "(0: the packaged cap)")
    if args.quick and args.write:
        raise ReproduceArgsError("--write with --quick: a scaled-down fit must not replace the "
                                 "packaged coefficients")
    record_path = ctx.path(FIT_RECORD)
    records = (json.loads(record_path.read_text(encoding="utf-8"))
               if record_path.exists() and not args.quick else {})
    for name in ctx.setups or tuple(CALIBRATION_CELLS):
        if name not in CALIBRATION_CELLS:
            raise ReproduceArgsError(f"--setups={name}: calibration needs paper Oracle values; "
                                     f"valid: {', '.join(CALIBRATION_CELLS)}")
        started = time.perf_counter()
        cal = calibrate_setup(ctx.runner, name, CALIBRATION_CELLS[name],
                              start_cap=args.start_cap or None,
                              num_iters=1 if args.quick else 3,
                              agent_divisor=8 if args.quick else 1)
        wall = time.perf_counter() - started
        records[name] = calibration_to_json(cal, wall)
        print(f"{name}: gpu_time_scale {cal.gpu_time_scale:.3f}, max_seqs_per_decode_engine "
              f"{cal.max_seqs_per_decode_engine}, RMS log residual "
              f"{cal.rms_log_before:.3f} -> "
              f"{cal.rms_log_after:.3f} ({cal.num_evals} evaluations, {wall:.0f} s)")
        for c in cal.cells:
            print(f"  {c.agents:>5} agents {c.mal}: paper {c.paper_s:,.0f} s, before "
                  f"{c.before_s:,.0f} s, after {c.after_s:,.0f} s ({100 * c.residual:+.1f}%)")
        if args.write:
            note = (f"fitted to paper Fig. 7 {name} Oracle JCTs at (agents, MAL) "
                    f"{list(CALIBRATION_CELLS[name])} by `dualpath reproduce calibrate --write`: "
                    f"gpu_time_scale {cal.gpu_time_scale:.3f} (all GPU times x k) on the packaged "
                    f"values it started from, max_seqs_per_decode_engine "
                    f"{cal.max_seqs_per_decode_engine} (sequences per decode engine) and "
                    f"hbm_reserve_fraction {cal.hbm_reserve_fraction:.3f} (the default); "
                    "residuals "
                    + ", ".join(f"{100 * c.residual:+.1f}%" for c in cal.cells))
            print(f"  wrote {write_fitted(cal, note)}")
    if not args.quick:
        record_path.write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
    return 0


def _calibrate_storage(args: argparse.Namespace, ctx: Context) -> int:
    if args.quick and args.write:
        raise ReproduceArgsError("--write with --quick: a scaled-down fit must not replace the "
                                 "packaged storage record")
    started = time.perf_counter()
    fits = calibrate_storage(ctx.runner, agent_divisor=8 if args.quick else 1)
    wall = time.perf_counter() - started
    for f in fits:
        print(f"{f.model.describe()}; RMS log residual "
              f"{f.rms_log_before:.3f} (nominal) -> {f.rms_log_after:.3f}")
    for c in fits[0].cells:
        print(f"  {c.agents:>5} agents {c.mal}: paper {c.paper_s:,.0f} s, nominal "
              f"{c.before_s:,.0f} s, fitted {c.after_s:,.0f} s ({100 * c.residual:+.1f}%)")
    print(f"{fits[0].num_evals} evaluations, {wall:.0f} s")
    if not args.quick:
        ctx.path(STORAGE_RECORD).write_text(fits_to_json(fits, wall), encoding="utf-8")
    if args.write:
        write_fit(fits[0])
        print("  wrote the packaged storage record (data/storage_calibration.json)")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.online_duration < 0:
        raise ReproduceArgsError(f"--online-duration={args.online_duration}: must be >= 0")
    if args.scale_out < 0 or args.scale_out == 1:
        raise ReproduceArgsError(f"--scale-out={args.scale_out}: must be >= 2 (0: default)")
    try:
        agents = tuple(int(a) for a in _csv(args.agents))
    except ValueError:
        raise ReproduceArgsError(
            f"--agents={args.agents}: expected integers like 512,1024") from None
    if args.jobs < 0:
        raise ReproduceArgsError(f"--jobs={args.jobs}: must be >= 0 (0: the machine's cores)")
    if args.out is None:
        args.out = default_out()
    runner = _logger(args.quiet)
    runner.jobs = args.jobs or os.cpu_count() or 1
    ctx = Context(args.out, runner, args.quick, agents, _csv(args.mal),
                  _csv(args.setups), args.online_duration, args.scale_out)
    for solo in ("calibrate", "calibrate-storage", "report"):
        if solo in args.experiments and len(args.experiments) > 1:
            raise ReproduceArgsError(f"`{solo}` runs alone")
    if args.ray and args.experiments != ["report"]:
        runner.ray = join(args.ray)
    try:
        return _run(args, ctx)
    finally:
        if runner.ray is not None:
            runner.ray.close()


def _run(args: argparse.Namespace, ctx: Context) -> int:
    runner = ctx.runner
    if args.experiments == ["calibrate"]:
        return _calibrate(args, ctx)
    if args.experiments == ["calibrate-storage"]:
        return _calibrate_storage(args, ctx)
    if args.experiments == ["report"]:
        path = assemble_report(args.out, args.report or args.out / REPORT_NAME)
        print(f"report: {path}")
        return 0
    keys = resolve(args.experiments)
    report = args.report
    if report is None and "all" in args.experiments:
        report = args.out / REPORT_NAME
    command = "dualpath reproduce " + " ".join(
        a for a in sys.argv[2:] if a) if sys.argv[1:2] == ["reproduce"] else "dualpath reproduce"
    sections = run_experiments(
        ctx, keys, report, command,
        progress=None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True)),
    )
    for s in sections:
        path = ctx.path(f"section_{s.key}.md")
        path.write_text(section_markdown(s, ctx.out_dir) + "\n", encoding="utf-8")
        print(f"{s.key}: {len(s.files)} files, {path} ({s.wall_s:.0f} s)")
    if report is not None:
        print(f"report: {report}")
    where = (f"on Ray: {runner.where() or 'none'}" if runner.ray is not None
             else f"{runner.jobs} jobs")
    print(f"simulated {len(ctx.runner.log)} runs, {ctx.runner.wall_s:.0f} s of run time "
          f"({where})")
    for f in runner.failures:
        print(f"failed on the cluster, then run here: {f.name} ({f.error})")
    return 0
