"""Issue 26 probe: does a bound on each request's own storage reads explain why the paper's
DualPath is slower than ours where storage is not saturated?

    python research/read_streams.py --jobs 2 [--sets ds27b,ds660b,qwen,fig8]
        [--agents 512,1024] [--streams 1,4] [--log RUNS.jsonl]

Each cell runs three ways (`dualpath.sim.SimParams`):

- `fifo`: the default: a node reads one request at a time at its storage NIC's calibrated rate;
- `shared`: a node reads all its queued requests at once, sharing that rate (processor
  sharing, `ReadDiscipline("shared")`), no per-request bound: isolates the discipline;
- `shared, N streams`: the same with each request's read also capped at N Full Block reads in
  flight, N x S / (L + S / r) (`read_streams_per_request`; L = 0.514 ms, r = 1.259 GB/s from
  3FS#410, whose benchmark ran 32 jobs of one read each). The NIC's calibrated rate still caps
  a node's reads together, so a storage-bound run keeps its rate and nothing is refitted.

The table gives JCTs and, where the project holds the paper's Fig. 7 value, the error. Qwen and
Fig. 8's P/D grid have no paper values here (issue 26 gives their error ranges only).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from dualpath.core.read_rate import parse_storage_read
from dualpath.plan.runner import RunSpec
from dualpath.reproduce.paper import fig7_point
from dualpath.sim import simulate
from dualpath.sim.config import ReadDiscipline

SETS = {
    "ds27b": ("ds27b_1p1d", 0, 0),
    "ds660b": ("ds660b_2p4d", 0, 0),
    "qwen": ("qwen32b_1p2d", 0, 0),
    "fig8": ("ds27b_1p1d", 1, 2),
}
MODES = ("basic", "dualpath")
"""The default modes (`--modes` takes any `Mode` preset: layerwise for Fig. 12's first step)."""


def run_cell(args: tuple[str, int, int, str, int, str, str, str, str]) -> dict[str, Any]:
    """One simulation: (setup, P, D, mode, agents, MAL, variant, storage, decode cap at) ->
    its summary."""
    setup, p, d, mode, agents, mal, variant, storage, cap_at = args
    cfg = RunSpec(setup, mode, agents, mal, num_prefill_nodes=p, num_decode_nodes=d).config()
    cfg = replace(cfg, params=replace(cfg.params, decode_cap_at=cap_at))
    if storage != "calibrated":
        cfg = replace(cfg, params=replace(cfg.params, storage_read=parse_storage_read(storage)))
    if variant != "fifo":
        shared = ReadDiscipline("shared", 0)
        streams = 0 if variant == "shared" else int(variant)
        cfg = replace(cfg, params=replace(cfg.params, pe_reads=shared, de_reads=shared,
                                          read_streams_per_request=streams))
    t0 = time.perf_counter()
    r = simulate(cfg)
    point = fig7_point(setup, agents, mal) if (p, d) == (0, 0) else None
    paper = point.jct_s.get(mode) if point is not None else None
    wall = time.perf_counter() - t0
    return {"setup": setup, "pd": f"{p}P{d}D" if p else "", "mode": mode, "agents": agents,
            "mal": mal, "variant": variant, "storage": storage, "decode_cap_at": cap_at,
            "jct_s": r.jct_s,
            "paper_jct_s": paper, "read_s": r.ttft_breakdown_s()["read"],
            "wall_s": wall}

Row = dict[str, Any]


def _variant_name(v: str) -> str:
    return v if v in ("fifo", "shared") else f"{v} stream{'s' if v != '1' else ''}"


def _variants(rows: list[Row]) -> list[str]:
    seen = {str(r["variant"]) for r in rows}
    return [v for v in ("fifo", "shared") if v in seen] + sorted(
        (v for v in seen if v not in ("fifo", "shared")), key=int)


def print_table(rows: list[Row]) -> None:
    """Every cell's JCT per variant (the error against the paper where held)."""
    variants = _variants(rows)
    by = {(r["setup"], r["pd"], r["mode"], r["agents"], r["mal"], r["variant"]): r
          for r in rows}
    head = " | ".join(f"{_variant_name(v)}: JCT s (err)" for v in variants)
    print(f"| setup | MAL | agents | mode | paper | {head} |")
    print("|" + "---|" * (5 + len(variants)))
    for key in sorted({k[:5] for k in by}):
        setup, pd, mode, agents, mal = key
        paper = next(by[(*key, v)]["paper_jct_s"] for v in variants if (*key, v) in by)
        cols = []
        for v in variants:
            r = by.get((*key, v))
            if r is None:
                cols.append("-")
                continue
            jct = float(r["jct_s"])
            err = f" ({(jct / float(paper) - 1) * 100:+.1f}%)" if paper else ""
            cols.append(f"{jct:,.0f}{err}")
        print(f"| {setup} {pd} | {mal} | {agents} | {mode} | {paper or '-'} | "
              f"{' | '.join(cols)} |")


def print_summary(rows: list[Row]) -> None:
    """Per setup and mode: mean |error| against the paper (where held) and, per setup, the
    geometric-mean DualPath/Basic speedup, for each variant."""
    variants = _variants(rows)
    print(f"\n| setup | what | {' | '.join(_variant_name(v) for v in variants)} |")
    print("|" + "---|" * (2 + len(variants)))
    groups = sorted({(str(r["setup"]), str(r["pd"])) for r in rows})
    for setup, pd in groups:
        mine = [r for r in rows if (r["setup"], r["pd"]) == (setup, pd)]
        # Only cells run under every variant, so each column sums the same cells.
        keys = [{(r["agents"], r["mal"], r["mode"]) for r in mine if r["variant"] == v}
                for v in variants]
        common = set.intersection(*keys)
        mine = [r for r in mine if (r["agents"], r["mal"], r["mode"]) in common]
        for mode in sorted({str(r["mode"]) for r in mine}):
            errs = []
            for v in variants:
                e = [abs(float(r["jct_s"]) / float(r["paper_jct_s"]) - 1) for r in mine
                     if r["mode"] == mode and r["variant"] == v and r["paper_jct_s"]]
                errs.append(f"{100 * sum(e) / len(e):.1f}% ({len(e)})" if e else "-")
            if any(x != "-" for x in errs):
                print(f"| {setup} {pd} | {mode}: mean abs error (cells) | {' | '.join(errs)} |")
        speedups = []
        for v in variants:
            jct = {(r["agents"], r["mal"], r["mode"]): float(r["jct_s"]) for r in mine
                   if r["variant"] == v}
            ratios = [jct[(a, m, "basic")] / jct[(a, m, "dualpath")] for a, m, mode in jct
                      if mode == "dualpath" and (a, m, "basic") in jct]
            speedups.append(f"{math.prod(ratios) ** (1 / len(ratios)):.2f}x" if ratios else "-")
        paper = {(r["agents"], r["mal"], r["mode"]): float(r["paper_jct_s"]) for r in mine
                 if r["paper_jct_s"]}
        held = [paper[(a, m, "basic")] / paper[(a, m, "dualpath")] for a, m, mode in paper
                if mode == "dualpath" and (a, m, "basic") in paper]
        held_s = f" (paper {math.prod(held) ** (1 / len(held)):.2f}x)" if held else ""
        if any(x != "-" for x in speedups):
            print(f"| {setup} {pd} | DualPath/Basic, geo-mean{held_s} | "
                  f"{' | '.join(speedups)} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="ds27b,ds660b,qwen",
                    help=f"comma-separated, of {', '.join(SETS)} (default: %(default)s)")
    ap.add_argument("--agents", default="512,1024", help="default: %(default)s")
    ap.add_argument("--mals", default="32k,48k,64k", help="default: %(default)s")
    ap.add_argument("--streams", default="1", help="N values to run (default: %(default)s)")
    ap.add_argument("--modes", default=",".join(MODES), help="default: %(default)s")
    ap.add_argument("--storage-read", default="calibrated", metavar="MODEL",
                    help="the storage read model, as `dualpath simulate --storage-read` "
                    "(default: %(default)s, the packaged flat 0.538)")
    ap.add_argument("--decode-cap-at", default="assign", choices=("assign", "decode"),
                    help="where the decode sequence cap holds a turn back "
                    "(`SimParams.decode_cap_at`; default: %(default)s, the simulator's)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--log", type=Path, help="append one JSON line per run here")
    ap.add_argument("--from-log", type=Path, metavar="RUNS.jsonl",
                    help="print the tables of an earlier --log instead of running")
    args = ap.parse_args(argv)
    for s in args.sets.split(","):
        if s not in SETS:
            ap.error(f"--sets: unknown set {s!r} (known: {', '.join(SETS)})")
    variants = ["fifo", "shared", *args.streams.split(",")]
    parse_storage_read(args.storage_read)  # a bad value fails here, with its message
    cells = [(*SETS[s], m, int(n), mal, v, args.storage_read, args.decode_cap_at)
             for s in args.sets.split(",") for mal in args.mals.split(",")
             for n in args.agents.split(",") for m in args.modes.split(",") for v in variants]
    t0 = time.perf_counter()
    if args.from_log:
        logged = [json.loads(line) for line in args.from_log.read_text().splitlines() if line]
        # A cell run again (the same variant in two invocations) counts once: the last.
        for r in logged:  # lines logged before --storage-read / --decode-cap-at
            r.setdefault("storage", "calibrated")
            r.setdefault("decode_cap_at", "assign")
        rows = list({(r["setup"], r["pd"], r["mode"], r["agents"], r["mal"], r["variant"],
                      r["storage"], r["decode_cap_at"]): r for r in logged}.values())
    else:
        with ProcessPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(run_cell, cells))
    if args.log:
        with args.log.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    for storage, cap_at in sorted({(str(r["storage"]), str(r["decode_cap_at"])) for r in rows}):
        mine = [r for r in rows if (r["storage"], r["decode_cap_at"]) == (storage, cap_at)]
        print(f"\nStorage read model: {storage}; decode cap at: {cap_at}\n")
        print_table(mine)
        print_summary(mine)
    if not args.from_log:
        print(f"\n{len(rows)} runs in {time.perf_counter() - t0:,.0f} s wall", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
