"""`dualpath serve` under NVIDIA's aiperf load generator, modes basic, dualpath and oracle.

For each mode this starts `dualpath serve` (SmolLM2-135M, emulated 1P1D; the storage NIC is
emulated), runs aiperf against it twice -- a synthetic profile (fixed input and output
lengths) and the public Mooncake conversation trace scaled to this model's context (its
512-token hash blocks become `--block-size`-token blocks, so turns that share hash ids share
prompt prefixes) -- with the local tokenizer folder (no download), and prints TTFT, ITL and
output throughput per mode, and each as a ratio to Basic from the same run.

aiperf is not a dependency of the package (`pip install -e '.[bench]'`, or a separate venv:
`python3 -m venv .venv-bench && .venv-bench/bin/pip install aiperf==0.13.0`; `--aiperf`
points at its executable).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("basic", "dualpath", "oracle")
TRACE = Path("/work/shared/data/mooncake/conversation_trace.jsonl")
MOONCAKE_BLOCK_TOKENS = 512


def scaled_trace(src: Path, out: Path, num_lines: int, block_tokens: int,
                 max_output_tokens: int) -> None:
    """The first `num_lines` turns of a Mooncake trace with `block_tokens`-token hash blocks
    (input lengths scaled alike, the last block partial as in the original)."""
    rows = []
    with src.open() as f:
        for line in f:
            if len(rows) == num_lines:
                break
            r = json.loads(line)
            n = len(r["hash_ids"])
            tail = r["input_length"] - (n - 1) * MOONCAKE_BLOCK_TOKENS
            tail = max(1, min(block_tokens, math.ceil(tail * block_tokens
                                                      / MOONCAKE_BLOCK_TOKENS)))
            rows.append({"timestamp": r["timestamp"], "hash_ids": r["hash_ids"],
                         "input_length": (n - 1) * block_tokens + tail,
                         "output_length": max(1, min(max_output_tokens, r["output_length"]))})
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))


def tokenizer_folder(model: Path, out: Path) -> Path:
    """A folder `transformers.AutoTokenizer` loads offline: the converted checkpoint's
    `tokenizer.json` with a `tokenizer_config.json` (without one it asks the Hub)."""
    out.mkdir(parents=True)
    shutil.copy(model / "tokenizer.json", out / "tokenizer.json")
    shutil.copy(model / "config.json", out / "config.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "bos_token": "<|im_start|>", "model_max_length": 8192}))
    return out


def start_server(mode: str, args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dualpath.cli.main", "serve", "--model", "smollm2", "--mode",
         mode, "--port", "0", "--quiet", "--engines-per-node", "1", "--estimator",
         "cost-model", "--served-model-name", "smollm2"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stderr is not None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise RuntimeError(f"dualpath serve --mode {mode} exited before it listened")
        m = re.search(r"(http://[\d.]+:\d+)/v1", line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise RuntimeError("dualpath serve did not start within 300 s")


def stop_server(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_aiperf(aiperf: str, url: str, tokenizer: Path, out: Path, extra: list[str],
               args: argparse.Namespace) -> dict[str, Any]:
    cmd = [aiperf, "profile", "-m", "smollm2", "--url", url, "--endpoint-type", "completions",
           "--streaming", "--tokenizer", str(tokenizer), "--concurrency",
           str(args.concurrency), "--request-count", str(args.requests), "--random-seed", "0",
           "--output-artifact-dir", str(out), "--no-gpu-telemetry", "--ui-type", "none",
           *extra]
    # Not HF_HUB_OFFLINE: aiperf 0.13 then looks the folder up in the Hub cache and fails; a
    # local folder is loaded from disk either way.
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    found = sorted(out.rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"no profile_export_aiperf.json under {out}")
    data: dict[str, Any] = json.loads(found[-1].read_text())
    return data


def metric(data: dict[str, Any], name: str, stat: str = "p50") -> float:
    m = data.get(name) or next((v for v in data.get("records", {}).values()
                                if isinstance(v, dict) and v.get("tag") == name), None)
    if not isinstance(m, dict) or m.get(stat) is None:
        raise KeyError(f"{name}.{stat} not in aiperf's export")
    return float(m[stat])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aiperf", default=shutil.which("aiperf") or ".venv-bench/bin/aiperf")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--input-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=32,
                    help="tokens per Mooncake hash block here (its own: 512)")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--profiles", nargs="+", default=["synthetic", "mooncake"],
                    choices=["synthetic", "mooncake"])
    args = ap.parse_args()
    if shutil.which(args.aiperf) is None:
        # An optional tool: `make bench` runs every benchmark and must not fail without it.
        print(f"bench_aiperf: skipped, no aiperf at {args.aiperf} (`make bench-serve` installs "
              "it into .venv-bench and runs this)")
        return
    from dualpath.runtime.model.weights import smollm2_folder

    profiles: dict[str, list[str]] = {
        "synthetic": ["--prompt-input-tokens-mean", str(args.input_tokens),
                      "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean",
                      str(args.output_tokens), "--prompt-output-tokens-stddev", "0",
                      "--extra-inputs", "ignore_eos:true"],
    }
    with tempfile.TemporaryDirectory(prefix="bench-aiperf-") as tmp:
        tokenizer = tokenizer_folder(smollm2_folder(), Path(tmp) / "tokenizer")
        if args.trace.exists():
            trace = Path(tmp) / "mooncake_scaled.jsonl"
            scaled_trace(args.trace, trace, args.requests, args.block_size, args.output_tokens)
            profiles["mooncake"] = ["--input-file", str(trace), "--custom-dataset-type",
                                    "mooncake_trace", "--prompt-input-tokens-block-size",
                                    str(args.block_size), "--no-fixed-schedule"]
        profiles = {p: v for p, v in profiles.items() if p in args.profiles}
        results: dict[str, dict[str, dict[str, float]]] = {p: {} for p in profiles}
        for mode in args.modes:
            proc, url = start_server(mode, args)
            try:
                for name, extra in profiles.items():
                    try:
                        data = run_aiperf(args.aiperf, url, tokenizer,
                                          Path(tmp) / mode / name, extra, args)
                    except RuntimeError as exc:  # reported, the other profiles still run
                        print(f"{mode} {name}: {str(exc)[-1500:]}", file=sys.stderr)
                        continue
                    results[name][mode] = {
                        "ttft_ms": metric(data, "time_to_first_token"),
                        "itl_ms": metric(data, "inter_token_latency"),
                        "tok_s": metric(data, "output_token_throughput", "avg"),
                    }
            finally:
                stop_server(proc)
    print(f"bench_aiperf: aiperf, SmolLM2-135M, emulated 1P1D (storage NIC emulated), "
          f"{args.requests} requests at concurrency {args.concurrency}; TTFT and ITL p50")
    for name, by_mode in results.items():
        shape = (f"ISL {args.input_tokens}, OSL {args.output_tokens}" if name == "synthetic"
                 else f"Mooncake conversation trace, {args.block_size}-token blocks")
        print(f"  {name} ({shape}):")
        ref = by_mode.get("basic")
        for mode, r in by_mode.items():
            rel = ""
            if ref is not None and mode != "basic":
                rel = (f"   vs basic: TTFT {r['ttft_ms'] / ref['ttft_ms']:.2f}x, ITL "
                       f"{r['itl_ms'] / ref['itl_ms']:.2f}x, throughput "
                       f"{r['tok_s'] / ref['tok_s']:.2f}x")
            print(f"    {mode:<9} TTFT {r['ttft_ms']:8.1f} ms  ITL {r['itl_ms']:7.1f} ms  "
                  f"{r['tok_s']:7.1f} tok/s{rel}")


if __name__ == "__main__":
    main()
