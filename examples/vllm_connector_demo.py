"""DualPathConnector in real vLLM (CPU) with SmolLM2-135M: persistence and the PE read path.

Three checks, each run in its own vLLM instance (a subprocess; one instance at a time), greedy,
fp32, vLLM's own prefix cache off (so every reused token comes from the store):

1. baseline  no connector: turn 1, then turn 2 (= turn 1 prompt + reply + a new user message),
             both computed in full.
2. connector a fresh store: turn 1 persists its full blocks (prompt and decode-filled ones),
             turn 2 loads its stored prefix from the store. Then the store file of turn 2's
             second block is corrupted (one payload byte flipped) and turn 2 runs again: the
             load error is reported, vLLM recomputes from that block, the recomputed block is
             written back.

Pass: the greedy tokens of both turns are identical across the two instances (and for the
corrupted rerun), turn 2 reports its stored tokens as cached, the event log shows the loads
and the one load error. Prints a JSON summary and exits non-zero on a failed check.

Run (in the vLLM venv, `make vllm-setup`): `.venv-vllm/bin/python examples/vllm_connector_demo.py`
(about 3-4 minutes on 2 CPU cores: mostly two vLLM start-ups).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pd_kit.prompts import SYSTEM

USER_1 = "Explain in detail why reading a cached prefix from storage can be faster than " \
         "recomputing it on the GPU."
USER_2 = "Now summarise that answer in two sentences."
TURN1_TOKENS = 64
TURN2_TOKENS = 24


def chat(tokenizer: Any, messages: list[tuple[str, str]]) -> list[int]:
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return list(tokenizer.encode(text + "<|im_start|>assistant\n"))


def turn2_prompt(tokenizer: Any, p1: list[int], out1: list[int]) -> list[int]:
    """Turn 1's prompt and reply token for token (the reused prefix), then the next message."""
    im_end = tokenizer.token_id("<|im_end|>")
    closing = [] if out1 and out1[-1] == im_end else [im_end]
    tail = tokenizer.encode(f"\n<|im_start|>user\n{USER_2}<|im_end|>\n<|im_start|>assistant\n")
    return p1 + out1 + closing + list(tail)


def run_phase(phase: str, model: str, store: Path, out: Path, args: argparse.Namespace
              ) -> None:
    """One vLLM instance: `baseline` (no connector) or `connector`."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from dualpath.core.blocks import block_keys, hit_blocks
    from dualpath.runtime.model.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(model)
    kwargs: dict[str, Any] = {}
    events = store / "events.jsonl"
    if phase == "connector":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="DualPathConnector", kv_role="kv_both",
            kv_connector_module_path="dualpath.integrations.vllm.connector.dualpath_connector",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"store_path": str(store), "durable": False,
                                       "event_log": str(events)})
    t0 = time.perf_counter()
    if args.block_size:
        kwargs["block_size"] = args.block_size
    if args.gpu_memory_utilization:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    llm = LLM(model=model, tokenizer=model, dtype=args.dtype, enforce_eager=not args.cuda_graphs,
              enable_prefix_caching=phase == "baseline" and args.baseline_prefix_cache,
              max_model_len=1024, max_num_seqs=4, seed=0,
              tensor_parallel_size=args.tensor_parallel_size, **kwargs)
    result: dict[str, Any] = {"phase": phase, "startup_s": round(time.perf_counter() - t0, 1)}

    def generate(ids: list[int], n: int) -> tuple[list[int], int | None, float]:
        t = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=n)
        (o,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        return list(o.outputs[0].token_ids), o.num_cached_tokens, time.perf_counter() - t

    p1 = chat(tok, [("system", SYSTEM), ("user", USER_1)])
    out1, cached1, s1 = generate(p1, TURN1_TOKENS)
    p2 = turn2_prompt(tok, p1, out1)
    if phase == "connector":
        from dualpath.store import BlockStore

        init = json.loads(events.read_text().splitlines()[0])
        bs, namespace = int(init["block_size"]), bytes.fromhex(init["namespace"])
        g = int(init.get("blocks_per_file", 1))  # a store file holds g blocks
        store_obj = BlockStore(store, g * int(init["full_block_bytes"]), is_durable=False)
        keys = block_keys(p2, bs, parent=namespace)
        result["block_size"] = bs
        result["blocks_in_store_after_turn1"] = len(store_obj.keys())
        # Turn 2 may reuse the stored blocks of its prompt, less one token to compute.
        result["expected_hit_tokens"] = bs * hit_blocks(keys, len(p2), store_obj.contains, bs,
                                                        blocks_per_file=g)
    out2, cached2, s2 = generate(p2, TURN2_TOKENS)
    result.update(p1_tokens=len(p1), out1=out1, cached1=cached1, turn1_s=round(s1, 1),
                  p2_tokens=len(p2), out2=out2, cached2=cached2, turn2_s=round(s2, 1),
                  text2=tok.decode(out2))
    if phase == "connector":
        result["blocks_in_store_after_turn2"] = len(store_obj.keys())
        # Corrupt turn 2's second file (block): one payload byte flipped (the header stays valid).
        victim = store_obj.path_of(keys[2 * g - 1])
        data = bytearray(victim.read_bytes())
        data[64 + 1000] ^= 0xFF
        victim.write_bytes(bytes(data))
        n_events = len(events.read_text().splitlines())
        out3, cached3, s3 = generate(p2, TURN2_TOKENS)
        result.update(out2_corrupt=out3, cached2_corrupt=cached3, turn2_corrupt_s=round(s3, 1))
        result["events"] = [json.loads(x) for x in events.read_text().splitlines()]
        result["events_of_rerun"] = result["events"][n_events:]
        buf = bytearray(store_obj.full_block_bytes)
        result["corrupt_block_rewritten_and_valid"] = store_obj.get_into(keys[2 * g - 1], buf)
    out.write_text(json.dumps(result))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="an HF-style Llama folder (default: converted SmolLM2)")
    ap.add_argument("--phase", choices=["baseline", "connector"], help=argparse.SUPPRESS)
    ap.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help="vLLM's dtype (default: %(default)s)")
    ap.add_argument("--cuda-graphs", action="store_true", help="CUDA graphs on (default: "
                    "enforce_eager)")
    ap.add_argument("--block-size", type=int, help="vLLM's block size (default: vLLM's)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--gpu-memory-utilization", type=float, help="each of the two instances' "
                    "share of the GPU (they run at once)")
    ap.add_argument("--baseline-prefix-cache", action="store_true", help="the baseline reuses "
                    "turn 1's KV from vLLM's own prefix cache, the numerics a store hit has (in "
                    "bf16 a full recompute may differ in the last bits, and so in a token)")
    args = ap.parse_args()
    if args.phase:
        run_phase(args.phase, args.model, args.store, args.out, args)
        return 0
    gpu_args = ["--dtype", args.dtype, "--tensor-parallel-size", str(args.tensor_parallel_size),
                *(["--cuda-graphs"] if args.cuda_graphs else []),
                *(["--block-size", str(args.block_size)] if args.block_size else []),
                *(["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
                  if args.gpu_memory_utilization else []),
                *(["--baseline-prefix-cache"] if args.baseline_prefix_cache else [])]
    if args.model is None:
        from dualpath.runtime.model.weights import smollm2_folder

        args.model = str(smollm2_folder())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the demo needs a few MB
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="dualpath-vllm-demo-") as tmp:
        # The two phases share nothing (the baseline has no connector, hence no store): run
        # them at once, which overlaps their engines' start-up (most of the demo's time).
        t = time.perf_counter()
        procs = {phase: subprocess.Popen(
            [sys.executable, __file__, "--phase", phase, "--model", args.model,
             "--store", str(Path(tmp) / "store"), "--out", str(Path(tmp) / f"{phase}.json"),
             *gpu_args],
            stdout=sys.stderr) for phase in ("baseline", "connector")}  # stdout: the JSON
        try:
            for phase, proc in procs.items():
                if proc.wait() != 0:
                    raise SystemExit(f"the {phase} phase failed with exit code "
                                     f"{proc.returncode}")
                results[phase] = json.loads((Path(tmp) / f"{phase}.json").read_text())
                print(f"== {phase}: done after {time.perf_counter() - t:.0f} s",
                      file=sys.stderr)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    base, conn = results["baseline"], results["connector"]
    bs = conn["block_size"]
    rerun = conn["events_of_rerun"]
    checks = {
        "turn1 tokens identical": base["out1"] == conn["out1"],
        "turn2 tokens identical (turn 2 from store)": base["out2"] == conn["out2"],
        "turn2 tokens identical (corrupt block recomputed)": base["out2"] == conn["out2_corrupt"],
        "turn1 had nothing cached": conn["cached1"] == 0,
        "baseline turn2 had nothing cached (or its prefix cache the same)": (
            base["cached2"] == (conn["cached2"] if args.baseline_prefix_cache else 0)),
        "turn2 cached tokens = turn 1's stored full blocks": (
            conn["cached2"] == conn["expected_hit_tokens"] >= 2 * bs),
        "rerun reported one load error": sum(e.get("error", False) for e in rerun) == 1,
        "corrupt block rewritten": conn["corrupt_block_rewritten_and_valid"],
    }
    summary = {
        "block_size": bs, "turn1_prompt_tokens": base["p1_tokens"],
        "turn1_output_tokens": len(base["out1"]), "turn2_prompt_tokens": base["p2_tokens"],
        "turn2_cached_tokens": {"baseline": base["cached2"], "connector": conn["cached2"],
                                "after_corruption": conn["cached2_corrupt"]},
        "blocks_in_store": {"after_turn1": conn["blocks_in_store_after_turn1"],
                            "after_turn2": conn["blocks_in_store_after_turn2"]},
        "turn2_s": {"baseline": base["turn2_s"], "connector": conn["turn2_s"],
                    "after_corruption": conn["turn2_corrupt_s"]},
        "startup_s": {"baseline": base["startup_s"], "connector": conn["startup_s"]},
        "turn2_text": conn["text2"],
        "load_events": [e for e in conn["events"] if e["event"] == "load"],
        "checks": checks,
    }
    print(json.dumps(summary, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
