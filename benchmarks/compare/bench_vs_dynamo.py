"""Yardstick: the Mooncake conversation trace through this simulator and through NVIDIA Dynamo's
trace replay (its mocker's offline replay, a Rust core), side by side in one run.

The trace is the conversation workload of the Mooncake FAST'25 trace release (repository
kvcache-ai/Mooncake, folder FAST25-release/traces/, Apache License 2.0): 12,031 requests of one
hour from Kimi, in ../shared/data/mooncake/ (its README says more).

The closest configurations the two share: 4 workers and the trace read in 512-token blocks.
Dynamo: 4 aggregated workers with a prefix cache, round robin, `replay_mode="offline"`,
`trace_block_size=512`. Ours: DS 27B on one prefill and one decode node of 2 GPUs each (2
prefill + 2 decode engines), `dualpath` mode, the trace replayed by its timestamps (hits from its
hash ids, 512 tokens each). They simulate different clusters (aggregated workers against P/D
with storage), so this compares speed, not results.

Each simulator runs as a whole process (start-up, trace load, replay, report), `--repeats`
times, alternating; medians of requests per wall second and per CPU second (user + system of
that process), simulated seconds per wall second, and peak memory (max RSS), and the ratios.

Dynamo lives in its own venv (`.venv-dynamo`, made on first use): ai-dynamo==1.6.1 and
ai-dynamo-runtime==1.6.1 installed with --no-deps (a plain install fails: one dependency is a
stub that downloads at install time), plus typing_extensions.

    python benchmarks/compare/bench_vs_dynamo.py [--repeats 3] [--trace PATH] [--dynamo-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"
DYNAMO_VENV = REPO / ".venv-dynamo"
DYNAMO_PINS = ["ai-dynamo==1.6.1", "ai-dynamo-runtime==1.6.1", "typing_extensions==4.16.0"]
NUM_WORKERS = 4
BLOCK_TOKENS = 512

# Run by the Dynamo venv's Python: the replay, then what it simulated, as one JSON line.
DYNAMO_CODE = f"""
import json, sys
from dynamo.replay import run_trace_replay
s = run_trace_replay(sys.argv[1], num_workers={NUM_WORKERS}, replay_mode="offline",
                     router_mode="round_robin", trace_block_size={BLOCK_TOKENS}).summary
print(json.dumps({{"completed": s["completed_requests"], "simulated_s": s["duration_ms"] / 1e3}}))
"""


@dataclass(frozen=True)
class Run:
    """One whole-process run of one simulator."""

    completed: int
    simulated_s: float
    wall_s: float
    cpu_s: float
    peak_mb: float


def measure(argv: list[str]) -> tuple[str, float, float, float]:
    """Run `argv`; its stdout, wall seconds, CPU seconds (user + system) and peak RSS in MB."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{' '.join(argv[:4])} ... failed ({proc.returncode}): "
                             f"{err.read()[-2000:]}")
        out.seek(0)
        # ru_maxrss is in KiB on Linux.
        return out.read(), wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def run_ours(trace: Path) -> Run:
    text, wall, cpu, peak = measure([
        sys.executable, "-m", "dualpath.cli.main", "simulate", "--model", "ds-27b",
        "--gpus-per-node", str(NUM_WORKERS // 2), "--prefill-nodes", "1", "--decode-nodes", "1",
        "--mooncake", str(trace), "--mode", "dualpath", "--json", "--no-progress"])
    summary = json.loads(text)["dualpath"]
    return Run(int(summary["num_completed"]), float(summary["duration_s"]), wall, cpu, peak)


def run_dynamo(python: Path, trace: Path) -> Run:
    text, wall, cpu, peak = measure([str(python), "-c", DYNAMO_CODE, str(trace)])
    got = json.loads(text.strip().splitlines()[-1])
    return Run(int(got["completed"]), float(got["simulated_s"]), wall, cpu, peak)


def dynamo_python(given: str | None) -> Path:
    """The Python with Dynamo's replay: `given`, else .venv-dynamo (made here on first use)."""
    if given:
        return Path(given)
    python = DYNAMO_VENV / "bin" / "python"
    if not python.exists():
        print(f"making {DYNAMO_VENV} ({', '.join(DYNAMO_PINS)}, --no-deps)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(DYNAMO_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", *DYNAMO_PINS],
                       check=True)
    return python


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trace", type=Path, default=TRACE,
                    help="Mooncake conversation trace (default: %(default)s)")
    ap.add_argument("--dynamo-python", metavar="PATH",
                    help="a Python with ai-dynamo 1.6.1 (default: .venv-dynamo, made if missing)")
    args = ap.parse_args()
    if not args.trace.exists():
        print(f"skipped: no trace at {args.trace} (the Mooncake conversation trace)")
        return
    python = dynamo_python(args.dynamo_python)
    import dualpath

    runs: dict[str, list[Run]] = {"dualpath": [], "dynamo": []}
    for _ in range(args.repeats):
        runs["dualpath"].append(run_ours(args.trace))
        runs["dynamo"].append(run_dynamo(python, args.trace))
    print(f"Mooncake conversation trace ({args.trace.name}), {NUM_WORKERS} workers, "
          f"{BLOCK_TOKENS}-token blocks, whole processes, median of {args.repeats}; "
          f"dualpath simulator: {dualpath.IMPLEMENTATION}")
    print(f"  {'simulator':<10} {'requests':>9} {'req/wall-s':>11} {'req/CPU-s':>10} "
          f"{'sim-s/wall-s':>13} {'wall s':>7} {'CPU s':>6} {'peak MB':>8}")
    med: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        m = {"req_wall": statistics.median(r.completed / r.wall_s for r in rs),
             "req_cpu": statistics.median(r.completed / r.cpu_s for r in rs),
             "sim_wall": statistics.median(r.simulated_s / r.wall_s for r in rs),
             "wall": statistics.median(r.wall_s for r in rs),
             "cpu": statistics.median(r.cpu_s for r in rs),
             "peak": statistics.median(r.peak_mb for r in rs)}
        med[name] = m
        print(f"  {name:<10} {rs[0].completed:>9,} {m['req_wall']:>11,.0f} {m['req_cpu']:>10,.0f} "
              f"{m['sim_wall']:>13,.0f} {m['wall']:>7.2f} {m['cpu']:>6.2f} {m['peak']:>8.0f}")
    ours, theirs = med["dualpath"], med["dynamo"]
    print(f"  dualpath / dynamo: {ours['req_wall'] / theirs['req_wall']:.2f}x requests per "
          f"wall second, {ours['req_cpu'] / theirs['req_cpu']:.2f}x per CPU second, "
          f"{ours['peak'] / theirs['peak']:.2f}x peak memory (goal: >= 3x per wall second)")


if __name__ == "__main__":
    main()
