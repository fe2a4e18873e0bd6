"""The simulator against the runtime it models, on the same work (issue 31, deliver 3).

Runs `dualpath run` (the emulated 1P2D cluster, the tiny model, real bytes through paced NICs)
in every mode on one set of trajectories `--repeats` times, and `dualpath simulate --profile`
with the runtime's profile (`dualpath profile --model tiny`, measured first unless `--profile`
names one) on the same trajectories, and prints each mode's JCT and speedup over Basic side by
side (medians of the real repeats; the simulation is deterministic). Nothing is fitted to the
compared runs: the simulator knows only the profile (step costs of one engine measured alone,
and the run configuration: NIC rates, engines, engine memory, block size, quota, beta).

Goal (issue 31): each speedup over Basic within 10%, each JCT within 20%.

Run: `.venv/bin/python benchmarks/sim_vs_real.py` (about 3.5 minutes per repeat on 2 cores;
`--repeats`, `--agents`, `--modes`, `--profile`, `--out`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dualpath.workload.jsonl import save_trajectories, trajectory_file
from dualpath.workload.synthetic import generate, preset

MODES = "basic,layerwise,dual-path,dualpath,split,oracle"
DUALPATH = [sys.executable, "-m", "dualpath.cli.main"]


def _dualpath(args: list[str]) -> str:
    done = subprocess.run([*DUALPATH, *args], capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"dualpath {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="real runs per mode (median)")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--modes", default=MODES)
    ap.add_argument("--max-len", type=int, default=1536)
    ap.add_argument("--append-scale", type=float, default=0.25)
    ap.add_argument("--gen-scale", type=float, default=0.05)
    ap.add_argument("--profile", type=Path, help="use this profile instead of measuring one")
    ap.add_argument("--out", type=Path, default=Path("sim_vs_real_out"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    traj = args.out / "trajectories.jsonl"
    save_trajectories(traj, trajectory_file(
        generate(preset("32k").with_num_trajectories(args.agents), 0)))
    shape = ["--trajectories", str(traj), "--agents", str(args.agents),
             "--append-scale", str(args.append_scale), "--gen-scale", str(args.gen_scale)]
    profile = args.profile
    if profile is None:
        profile = args.out / "profile-tiny.json"
        print(f"profiling the tiny model's engine -> {profile}", file=sys.stderr, flush=True)
        _dualpath(["profile", "--model", "tiny", "--no-progress", "--out", str(profile)])
    sim = json.loads(_dualpath(["simulate", "--profile", str(profile), "--prefill-nodes", "1",
                                "--decode-nodes", "2", "--mode", args.modes, "--mal",
                                str(args.max_len), "--json", "--no-progress", *shape]))
    modes = list(sim)
    real: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(args.repeats):
        started = time.perf_counter()
        out = json.loads(_dualpath(["run", "--mode", args.modes, "--max-len", str(args.max_len),
                                    "--json", "--no-progress", *shape]))
        for m in modes:
            real[m].append(out[m]["jct_s"])
        print(f"real run {i + 1}/{args.repeats}: {time.perf_counter() - started:.0f} s wall: "
              + ", ".join(f"{m} {out[m]['jct_s']:.2f} s" for m in modes),
              file=sys.stderr, flush=True)
    med = {m: statistics.median(v) for m, v in real.items()}
    sim_jct = {m: float(sim[m]["jct_s"]) for m in modes}
    rows = []
    for m in modes:
        rs, ss = med["basic"] / med[m], sim_jct["basic"] / sim_jct[m]
        rows.append({
            "mode": m, "real_jct_s": med[m], "real_jct_runs": real[m], "sim_jct_s": sim_jct[m],
            "jct_error": sim_jct[m] / med[m] - 1, "real_speedup": rs, "sim_speedup": ss,
            "speedup_error": ss / rs - 1,
        })
    lines = [
        f"| mode | real JCT s (median of {args.repeats}) | sim JCT s | JCT error | "
        "real speedup | sim speedup | speedup error |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        jok = "" if abs(r["jct_error"]) <= 0.20 else " (miss)"
        sok = "" if abs(r["speedup_error"]) <= 0.10 else " (miss)"
        lines.append(
            f"| {r['mode']} | {r['real_jct_s']:.2f} ({min(r['real_jct_runs']):.2f}-"
            f"{max(r['real_jct_runs']):.2f}) | {r['sim_jct_s']:.2f} | "
            f"{r['jct_error']:+.0%}{jok} | {r['real_speedup']:.2f}x | {r['sim_speedup']:.2f}x | "
            f"{r['speedup_error']:+.0%}{sok} |")
    table = "\n".join(lines)
    print(table)
    (args.out / "sim_vs_real.json").write_text(json.dumps({
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(sys.argv), "profile": str(profile), "rows": rows,
    }, indent=1) + "\n", encoding="utf-8")
    (args.out / "sim_vs_real.md").write_text(table + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
