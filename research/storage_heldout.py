"""The held-out cells of issue 26 under the packaged storage read model and under the
3FS-derived `queued` form at the same fitted rate (`dualpath.core.read_rate`), side by side.

    python research/storage_heldout.py --jobs 2 [--sets fig8,fig9,fig12,qwen] [--csv PATH]
        [--log RUNS.jsonl]

The simulator sees one read rate per storage NIC, that of the model's Full Block, so each form
runs as `RunSpec.storage` = (its rate for the setup's block as a fraction of the line rate, 0).
DS 27B's block is the fitted one: both forms read it at the same rate, so Fig. 8 (DS 27B only)
cannot move and is run once. The project holds no paper values for these cells (only the
paper's stated claims: Fig. 9's speedup range, Fig. 12's reductions), so the tables give our
JCTs under each form, their ratio, and for Basic runs how busy the reading storage NICs were
(bytes read / (rate x JCT x reading nodes)).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from dualpath.core.read_rate import StorageReadModel
from dualpath.plan.runner import Runner, RunSpec, block_bytes, storage_fraction
from dualpath.plan.setups import setup
from dualpath.plan.storage_note import FIT_SETUP, fit_block_bytes
from dualpath.reproduce.ablation import ABLATION, PAPER_ABLATION_REDUCTION
from dualpath.reproduce.offline import FIG9_FACTORS
from dualpath.reproduce.storage_fit import model_of, packaged_model
from dualpath.sim import SimResult

SETS = ("fig8", "fig9", "fig12", "qwen")
FACTORS = FIG9_FACTORS  # the fig9 section's scales (0.5x-4x in the 2026-12-03 runs)
SYSTEMS = ("oracle", "dualpath", "basic")


def queued_model() -> StorageReadModel:
    """The `queued` form reading the fitted setup's blocks at the packaged model's rate."""
    return model_of("queued", storage_fraction(packaged_model(), FIT_SETUP))


def cells(which: Iterable[str]) -> list[tuple[str, dict[str, object]]]:
    """(set, RunSpec fields without storage) of every held-out cell."""
    out: list[tuple[str, dict[str, object]]] = []
    for s in which:
        if s == "fig8":
            out += [("fig8", {"setup": "ds27b_1p1d", "mode": m, "num_agents": n, "mal": mal,
                              "num_prefill_nodes": p, "num_decode_nodes": d})
                    for mal in ("32k", "48k", "64k") for n in (512, 1024, 2048)
                    for p, d in ((1, 1), (2, 1), (1, 2)) for m in ("basic", "dualpath")]
        elif s == "fig9":
            out += [("fig9", {"setup": "ds660b_2p4d", "mode": m, "num_agents": 1024,
                              "mal": "64k", kind: f})
                    for kind in ("append_factor", "gen_factor") for f in FACTORS
                    for m in SYSTEMS]
        elif s == "fig12":
            out += [("fig12", {"setup": "ds660b_2p4d", "mode": m, "num_agents": n, "mal": "64k"})
                    for n in (1024, 2048) for m in ABLATION]
        elif s == "qwen":
            out += [("qwen", {"setup": "qwen32b_1p2d", "mode": m, "num_agents": n, "mal": mal})
                    for mal in ("32k", "48k", "64k") for n in (512, 1024, 2048) for m in SYSTEMS]
        else:
            raise SystemExit(f"--sets: {s!r}: must be one of {', '.join(SETS)}")
    return out


def busy(spec: RunSpec, jct_s: float, read_bytes: tuple[float, ...], frac: float) -> float:
    """Mean busy share of the prefill nodes' storage NICs over the run (Basic reads there)."""
    cl = setup(spec.setup).cluster()
    num_pe = spec.num_prefill_nodes or cl.num_prefill_nodes
    rate = frac * cl.hardware.storage_nic_bytes_per_s
    return sum(read_bytes[:num_pe]) / (rate * jct_s * num_pe)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--csv", type=Path, default=None)
    ap.add_argument("--log", type=Path, default=None, help="append each finished run (JSON lines)")
    args = ap.parse_args()
    flat, queued = packaged_model(), queued_model()
    print(f"packaged: {flat.describe()}\nqueued:   {queued.describe()}")
    names = ("ds27b_1p1d", "ds660b_2p4d", "qwen32b_1p2d")
    frac = {f: {n: storage_fraction(m, n) for n in names} for f, m in (("flat", flat),
                                                                ("queued", queued))}
    for n in names:
        s = block_bytes(n)
        print(f"  {n}: Full Block {s / 1e6:.2f} MB, flat {frac['flat'][n]:.3f}, queued "
              f"{frac['queued'][n]:.3f} (one read {queued.read_time_s(s) * 1e3:.3f} ms, "
              f"latency {100 * queued.read_latency_s / queued.read_time_s(s):.0f}% of it)")
    assert abs(frac["flat"][FIT_SETUP] - frac["queued"][FIT_SETUP]) < 1e-9 * (1 + fit_block_bytes())
    todo = cells(args.sets.split(","))
    specs: dict[tuple[int, str], RunSpec] = {}
    for i, (_, kw) in enumerate(todo):
        for form in ("flat", "queued"):
            name = str(kw["setup"])
            # Oracle reads nothing and DS 27B's block is the fitted one: the same run.
            same = kw["mode"] == "oracle" or name == FIT_SETUP
            rate = frac["flat" if same else form][name]
            specs[(i, form)] = RunSpec(**kw, storage=(rate, 0.0))  # type: ignore[arg-type]
    runner = Runner(jobs=args.jobs, progress=True)
    if args.log:  # each run as it ends: a long sweep killed early keeps what it made
        log_fh = args.log.open("a")

        def on_run(spec: RunSpec, res: SimResult, wall: float) -> None:
            log_fh.write(json.dumps({"spec": asdict(spec), "jct_s": res.jct_s, "wall_s": wall,
                                     "read_bytes": res.storage_read_bytes_by_node}) + "\n")
            log_fh.flush()

        runner.on_run = on_run
    started = time.perf_counter()
    runner.prefetch(specs.values())
    print(f"{len(runner.log)} runs, {time.perf_counter() - started:.0f} s wall", file=sys.stderr)
    rows: list[list[object]] = []
    for i, (set_name, kw) in enumerate(todo):
        res = {f: runner.run(specs[(i, f)]) for f in ("flat", "queued")}
        extra = ("append x" + str(kw["append_factor"]) if "append_factor" in kw else
                 "gen x" + str(kw["gen_factor"]) if "gen_factor" in kw else
                 f"{kw.get('num_prefill_nodes', '')}P{kw.get('num_decode_nodes', '')}D"
                 if "num_prefill_nodes" in kw else "")
        row: list[object] = [set_name, kw["setup"], extra, kw["num_agents"], kw["mal"],
                             kw["mode"]]
        row += [round(res[form].jct_s, 1) for form in ("flat", "queued")]
        row.append(round(res["queued"].jct_s / res["flat"].jct_s, 4))
        for form in ("flat", "queued"):
            sp, out = specs[(i, form)], res[form]
            row.append(round(busy(sp, out.jct_s, out.storage_read_bytes_by_node,
                                  sp.storage[0]), 3)  # type: ignore[index]
                       if kw["mode"] == "basic" else "")
        rows.append(row)
    head = ["set", "setup", "variant", "agents", "mal", "mode", "flat_jct_s", "queued_jct_s",
            "queued_over_flat", "pe_snic_busy_flat", "pe_snic_busy_queued"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for line in rows:
        print("| " + " | ".join(str(x) for x in line) + " |")
    _summaries(rows)
    if args.csv:
        with args.csv.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(head)
            w.writerows(rows)
    return 0


def _summaries(rows: list[list[object]]) -> None:
    """The paper's stated claims these sets carry, under each form."""
    jct = {(r[0], r[2], r[3], r[4], r[5]): (float(str(r[6])), float(str(r[7]))) for r in rows}
    for k, form in ((0, "flat"), (1, "queued")):
        sp9 = [jct[("fig9", f"append x{f}", 1024, "64k", "basic")][k]
               / jct[("fig9", f"append x{f}", 1024, "64k", "dualpath")][k]
               for f in FACTORS if ("fig9", f"append x{f}", 1024, "64k", "basic") in jct]
        if sp9:
            print(f"{form}: Fig. 9 append speedups "
                  + ", ".join(f"{s:.2f}x" for s in sp9) + " (paper 1.82-1.99x)")
        red = {m: [100 * (1 - jct[("fig12", "", n, "64k", m)][k]
                          / jct[("fig12", "", n, "64k", "basic")][k]) for n in (1024, 2048)]
               for m in ABLATION[1:] if ("fig12", "", 1024, "64k", m) in jct}
        for m, v in red.items():
            print(f"{form}: Fig. 12 {m}: JCT reduction vs Basic {sum(v) / len(v):.1f}% "
                  f"(paper {PAPER_ABLATION_REDUCTION[m]:.2f}%)")
        qs = [jct[("qwen", "", n, mal, "basic")][k] / jct[("qwen", "", n, mal, "dualpath")][k]
              for mal in ("32k", "48k", "64k") for n in (512, 1024, 2048)
              if ("qwen", "", n, mal, "basic") in jct]
        if qs:
            geo = 1.0
            for s in qs:
                geo *= s
            print(f"{form}: Qwen DualPath/Basic geo-mean {geo ** (1 / len(qs)):.2f}x "
                  "(paper 1.63x per issue 26)")


if __name__ == "__main__":
    raise SystemExit(main())
