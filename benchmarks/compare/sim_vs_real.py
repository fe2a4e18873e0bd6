"""The simulator against the runtime it models, on the same work (issue 31, deliver 3).

Runs `dualpath run` (the emulated 1P2D cluster, the tiny model, real bytes through paced NICs)
in every mode on one set of trajectories `--repeats` times, and `dualpath simulate --profile`
with the runtime's profile (`dualpath profile --model tiny`, measured first unless `--profile`
names one) on the same trajectories, and prints each mode's JCT and speedup over Basic side by
side (medians of the real repeats; the simulation is deterministic). Nothing is fitted to the
compared runs: the simulator knows only the profile (step costs of one engine measured alone,
the control plane's per-turn latencies timed on turns of its own, and the run configuration:
NIC rates, engines, engine memory, block size, quota, beta).

Goal (issue 31): each speedup over Basic within 10%, each JCT within 20%.

Run: `.venv/bin/python benchmarks/compare/sim_vs_real.py` (about 3.5 minutes per repeat on 2 cores;
`--repeats`, `--agents`, `--modes`, `--profile`, `--out`).

`--vllm PROFILE` runs the vLLM half instead: `benchmarks/vllm/vllm_pd_bench.py` (1P1D unless
`--prefill` / `--decode`; its defaults: 4 agents whose turn 2 reads 7 stored blocks through
emulated 0.1 Gb/s storage NICs, all sent at once, background loads; medians of its repeats) in
`.venv-vllm`, against `dualpath simulate`'s engine on the vLLM profile (`dualpath profile
--engine vllm`) with the same turns: each agent one turn of the bench's turn-2 prompt
(tokenized here with SmolLM2's tokenizer in ChatML, the 8-token reply counted as 8), its stored
prefix as the hit the bench's router reported, 8 tokens generated, all at t = 0. The storage
NICs serve reads as the profile's `run.storage_reads` says (the connector's read paths); the
table also shows the simulation with `fifo` reads on both sides (the paper's read queue). Mean
TTFT and JCT per mode, and each mode's ratio to Basic. `--bench-json FILE` takes the real half
from an earlier run's output (e.g. `research/runs/`) instead of running it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
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


def _bench_prompt_tokens(agent: str, filler: int) -> int:
    """Tokens of `vllm_pd_bench.py`'s turn-2 prompt for `agent` (ChatML, an 8-token reply)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))
    from vllm_pd_bench import system_prompt

    from dualpath.runtime.model.weights import load_tokenizer, smollm2_folder

    tok = load_tokenizer(smollm2_folder())
    text = (f"<|im_start|>system\n{system_prompt(agent, filler)}<|im_end|>\n"
            "<|im_start|>user\nList the resources that limit a prefill.<|im_end|>\n"
            "<|im_start|>assistant\n")
    tail = "<|im_end|>\n<|im_start|>user\nWhich one binds here?<|im_end|>\n<|im_start|>assistant\n"
    return len(tok.encode(text)) + 8 + len(tok.encode(tail))


def vllm_half(args: argparse.Namespace) -> int:
    """The storage-bound vLLM P/D benchmark against the simulator on the vLLM profile."""
    from dualpath.plan.step_profile import load_profile
    from dualpath.sim import Driver, SimConfig, Workload, mode_preset, simulate
    from dualpath.sim.config import FIFO

    prof = load_profile(args.vllm)
    vllm_py = Path(".venv-vllm/bin/python")
    cmd = [str(vllm_py), str(Path(__file__).resolve().parents[1] / "vllm" / "vllm_pd_bench.py"),
           "--agents", str(args.agents), "--repeats", str(args.repeats),
           "--prefill", str(args.prefill), "--decode", str(args.decode),
           "--storage-read-gbps", f"{prof.run['storage_nic_bytes_per_s'] * 8 / 1e9:g}"]
    if args.bench_json is not None:
        bench = json.loads(args.bench_json.read_text(encoding="utf-8"))
        bench = bench.get("bench", bench)  # this script's own output holds the bench's
    else:
        print("running " + " ".join(cmd), file=sys.stderr, flush=True)
        started = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            sys.exit(f"vllm_pd_bench.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
        bench = json.loads(done.stdout)
        print(f"bench: {time.perf_counter() - started:.0f} s wall, clean {bench['clean']}",
              file=sys.stderr, flush=True)
    args.agents, args.repeats = bench["agents"], bench["repeats"]
    num_p, num_d = int(bench.get("prefill", 1)), int(bench.get("decode", 1))
    pe_reads, de_reads = prof.read_disciplines()
    is_async = bench.get("loads", "async") == "async"
    if (pe_reads.kind == "shared") != is_async:
        sys.exit(f"{args.vllm}: storage reads {pe_reads.describe()} on the PE side, but the bench "
                 f"ran with {bench.get('loads')} loads: profile with --loads "
                 f"{bench.get('loads')}")
    modes = list(bench["median"])
    block = int(prof.run["block_size"])
    full_block_bytes = block * int(prof.model["kv_bytes_per_token"])
    hits = bench["hit_bytes_by_side"]["basic"][0]
    hit_tokens = (hits["pe"] + hits["de"]) // full_block_bytes // args.agents * block
    prompt = _bench_prompt_tokens("basic-0-0", 30)
    workload = Workload.from_lists([[(prompt, hit_tokens, 8)] for _ in range(args.agents)])
    kw = prof.sim_kwargs()
    base = SimConfig(prof.cluster(num_p, num_d), workload,
                     driver=Driver(num_agents=args.agents), **kw)
    fifo = replace(base, params=replace(base.params, pe_reads=FIFO, de_reads=FIFO))
    rows = []
    sim: dict[str, dict[str, float]] = {}
    sim_fifo: dict[str, dict[str, float]] = {}
    ttfts: dict[str, list[float]] = {}
    for m in modes:
        res = simulate(replace(base, mode=mode_preset(m)))
        sim[m] = {"ttft_s": float(res.ttft_s.mean()),
                  "jct_s": float(res.trajectory_jct_s().mean())}
        ttfts[m] = [round(float(t), 3) for t in sorted(res.ttft_s)]
        res = simulate(replace(fifo, mode=mode_preset(m)))
        sim_fifo[m] = {"ttft_s": float(res.ttft_s.mean()),
                       "jct_s": float(res.trajectory_jct_s().mean())}
    for m in modes:
        real = bench["median"][m]
        rows.append({"mode": m, **{f"real_{k}": real[k] for k in ("ttft_s", "jct_s")},
                     **{f"sim_{k}": sim[m][k] for k in ("ttft_s", "jct_s")},
                     "real_ttft_ratio": real["ttft_s"] / bench["median"]["basic"]["ttft_s"],
                     "sim_ttft_ratio": sim[m]["ttft_s"] / sim["basic"]["ttft_s"],
                     "real_jct_ratio": real["jct_s"] / bench["median"]["basic"]["jct_s"],
                     "sim_jct_ratio": sim[m]["jct_s"] / sim["basic"]["jct_s"]})
    for r in rows:
        r["sim_fifo_ttft_s"] = sim_fifo[r["mode"]]["ttft_s"]
        r["sim_fifo_jct_s"] = sim_fifo[r["mode"]]["jct_s"]
    lines = [f"vLLM {num_p}P{num_d}D, {args.agents} agents, prompt {prompt} tokens, hit "
             f"{hit_tokens}, 8 generated; real: medians of {args.repeats} (clean "
             f"{bench['clean']}); sim reads: PE {pe_reads.describe()}, DE {de_reads.describe()}",
             "", "| mode | real TTFT s | sim TTFT s | error | sim fifo | real JCT s | sim JCT s | "
             "error | sim fifo | real / sim TTFT ratio to basic | real / sim JCT ratio to basic |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def err(sim_s: float, real_s: float, tol: float) -> str:
        return f"{sim_s / real_s - 1:+.0%}" + ("" if abs(sim_s / real_s - 1) <= tol else " (miss)")

    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['real_ttft_s']:.2f} | {r['sim_ttft_s']:.2f} | "
            f"{err(r['sim_ttft_s'], r['real_ttft_s'], 0.2)} | {r['sim_fifo_ttft_s']:.2f} | "
            f"{r['real_jct_s']:.2f} | {r['sim_jct_s']:.2f} | "
            f"{err(r['sim_jct_s'], r['real_jct_s'], 0.2)} | {r['sim_fifo_jct_s']:.2f} | "
            f"{r['real_ttft_ratio']:.2f} / {r['sim_ttft_ratio']:.2f} | "
            f"{r['real_jct_ratio']:.2f} / {r['sim_jct_ratio']:.2f} |")
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim_vs_vllm.json").write_text(json.dumps({
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(sys.argv), "profile": str(args.vllm), "bench": bench,
        "sim": sim, "sim_fifo": sim_fifo, "sim_ttfts_s": ttfts, "rows": rows,
        "sim_reads": {"pe": pe_reads.describe(), "de": de_reads.describe()},
        "prompt_tokens": prompt, "hit_tokens": hit_tokens,
    }, indent=1) + "\n", encoding="utf-8")
    (args.out / "sim_vs_vllm.md").write_text(table + "\n", encoding="utf-8")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="real runs per mode (median)")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--modes", default=MODES)
    ap.add_argument("--max-len", type=int, default=1536)
    ap.add_argument("--append-scale", type=float, default=0.25)
    ap.add_argument("--gen-scale", type=float, default=0.05)
    ap.add_argument("--profile", type=Path, help="use this profile instead of measuring one")
    ap.add_argument("--out", type=Path,
                    default=Path(os.environ.get("DUALPATH_OUT", "out")) / "sim_vs_real",
                    help="where the tables go (default: $DUALPATH_OUT/sim_vs_real, else "
                    "out/sim_vs_real)")
    ap.add_argument("--vllm", type=Path, metavar="PROFILE",
                    help="the vLLM half: vllm_pd_bench.py against this vLLM profile "
                    "(--agents default 4, --repeats 2 there)")
    ap.add_argument("--prefill", type=int, default=1, metavar="N",
                    help="with --vllm: prefill instances (default: %(default)s)")
    ap.add_argument("--decode", type=int, default=1, metavar="N",
                    help="with --vllm: decode instances (default: %(default)s)")
    ap.add_argument("--bench-json", type=Path, metavar="FILE",
                    help="with --vllm: vllm_pd_bench.py's output of an earlier run (not run "
                    "again)")
    args = ap.parse_args()
    if args.vllm is not None:
        if "--agents" not in sys.argv:
            args.agents = 4
        if "--repeats" not in sys.argv:
            args.repeats = 2
        return vllm_half(args)
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
