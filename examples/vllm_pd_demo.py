"""DualPath's P/D flow in real vLLM (CPU) with SmolLM2-135M: both read paths between a prefill
and a decode vLLM server, over NIXL (UCX on loopback), on one shared store.

A 1P1D cluster (`integrations.vllm.cluster.launch`) is started; every request is sent the
router's way
(`RouteParams` in `kv_transfer_params`: the prefill server computes the prompt with one output
token and pushes the KV the decode server lacks; the decode server loads it and decodes), with
the read path forced per request:

1. turn 1, sent straight to the decode server (no P/D: it computes and persists everything);
2. turn 1 through P/D, nothing cached: the same tokens;
3. turn 2 (= turn 1's prompt + reply + a new message) through P/D with hit_blocks 0: full
   recompute, the reference;
4. turn 2, PE read path (the prefill server reads the stored prefix);
5. turn 2, DE read path (the decode server reads it into its staging buffer, the prefill
   server pulls it layer by layer over NIXL; only the rest goes back);
6. turn 2, split (block 0 on the PE side, the rest on the DE side);
7. one stored block corrupted, turn 2 on the DE path again: recomputed;
8. through `dualpath route` (three router processes on the same cluster, the `openai` client):
   a chat conversation's turn 2 in `basic` (PE path) and with `--force-read-side de` gives the
   same reply; two concurrent turn-2 requests in `dualpath` mode: the second, arriving while
   the first's PE-side read is queued, takes the DE path (the shorter read queue);
9. with `--failover`, the kill test on the same cluster (`pd_kit/failover.py`): the
   decode server, then the prefill server SIGKILLed under load behind the router and
   restarted; every request not yet streaming gets the tokens of a run without the kill.

Pass: every turn-2 reply equals the reference token for token (greedy), the cached-token counts
and the connectors' event logs show where each block came from. Prints JSON; non-zero exit on a
failed check. Run in the vLLM venv (`make vllm-setup`): `.venv-vllm/bin/python
examples/vllm_pd_demo.py` (a few minutes on 2 cores, mostly the two servers' start-up).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from dualpath.core.blocks import block_keys
from dualpath.integrations.vllm.cluster.launch import Instance, VllmCluster
from dualpath.integrations.vllm.cluster.spec import HOST_MODES, HOSTS_HELP, VllmClusterSpec
from dualpath.integrations.vllm.manifest import RouteParams, find_manifest
from dualpath.runtime.model.tokenizer import Tokenizer
from dualpath.store import BlockStore
from pd_kit.failover import NUM_PROMPTS, failover_phase, shm_left
from pd_kit.failover import checks as failover_checks
from pd_kit.prompts import SYSTEM, USER_1, USER_2
from pd_kit.router import router, stats


def post(url: str, body: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def complete(inst: Instance, model: str, prompt: list[int], max_tokens: int,
             params: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    return post(inst.url + "/v1/completions", body)


def token_ids(reply: dict[str, Any]) -> list[int]:
    return list(reply["choices"][0].get("token_ids") or [])


def cached(reply: dict[str, Any]) -> int:
    details = (reply.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def pd_turn(cluster: VllmCluster, model: str, prompt: list[int], max_tokens: int,
            hit_blocks: int, pe_blocks: int) -> dict[str, Any]:
    """One request the router's way, with the read path given."""
    p, d = cluster.prefill[0], cluster.decode[0]
    assert d.side_channel is not None
    route = RouteParams(xfer=uuid.uuid4().hex, de=d.side_channel, hit_blocks=hit_blocks,
                        pe_blocks=pe_blocks)
    t0 = time.perf_counter()
    first = complete(p, model, prompt, 1, route.to_params())
    t1 = time.perf_counter()
    back = first.get("kv_transfer_params")
    second = complete(d, model, prompt, max_tokens, back)
    t2 = time.perf_counter()
    return {"out": token_ids(second), "prefill_cached": cached(first),
            "decode_cached": cached(second), "returned_params": back,
            "prefill_s": round(t1 - t0, 2), "total_s": round(t2 - t0, 2)}


def router_phase(cluster: VllmCluster, store: Path, model: str) -> dict[str, Any]:
    """Step 8: the router, driven by the `openai` client."""
    from openai import OpenAI

    def chat(url: str, messages: list[dict[str, str]], n: int) -> str:
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        r = client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=n, temperature=0.0)
        return r.choices[0].message.content or ""

    turn1: list[dict[str, str]] = [{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": USER_1}]
    out: dict[str, Any] = {}
    with router(cluster, store, "--mode", "basic") as basic, \
            router(cluster, store, "--mode", "dualpath", "--force-read-side", "de") as de, \
            router(cluster, store, "--mode", "dualpath") as dual:
        reply1 = chat(basic, turn1, 32)
        turn2 = [*turn1, {"role": "assistant", "content": reply1},
                 {"role": "user", "content": USER_2}]
        out["reply2_basic"] = chat(basic, turn2, 16)
        out["reply2_de"] = chat(de, turn2, 16)
        out["stats_basic"] = stats(basic)
        out["stats_de"] = stats(de)
        replies: list[str] = []
        threads = [threading.Thread(target=lambda: replies.append(chat(dual, turn2, 4)))
                   for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join()
        out["replies_dual"] = replies
        out["stats_dual"] = stats(dual)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--model", help="an HF-style Llama folder (default: converted SmolLM2)")
    ap.add_argument("--turn1-tokens", type=int, default=64)
    ap.add_argument("--turn2-tokens", type=int, default=16)
    ap.add_argument("--workdir", type=Path, help="keep the store, logs and event logs here "
                    "(default: a temporary folder, removed)")
    ap.add_argument("--hosts", choices=HOST_MODES, default="loopback", help=HOSTS_HELP)
    ap.add_argument("--dtype", default="float32", help="vLLM's dtype (default: %(default)s)")
    ap.add_argument("--cuda-graphs", action="store_true", help="CUDA graphs on (default: "
                    "--enforce-eager)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--gpus", help="comma-separated GPU ids, tensor-parallel-size per server "
                    "(an id may repeat: servers sharing a GPU)")
    ap.add_argument("--vllm-args", default="", help="more vLLM server arguments, one string "
                    "(e.g. '--block-size 16 --gpu-memory-utilization 0.3')")
    ap.add_argument("--failover", action="store_true", help="then kill the decode and the "
                    "prefill server under load, separately (step 9; about 2.5 minutes)")
    args = ap.parse_args()
    if args.model is None:
        from dualpath.runtime.model.weights import smollm2_folder

        args.model = str(smollm2_folder())
    tok = Tokenizer.from_folder(args.model)
    text = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{USER_1}<|im_end|>\n"
    p1 = list(tok.encode(text + "<|im_start|>assistant\n"))
    with tempfile.TemporaryDirectory(prefix="dualpath-vllm-pd-") as tmp:
        work = args.workdir or Path(tmp)
        spec = VllmClusterSpec(model=args.model, store=work / "store", python=sys.executable,
                           hosts=args.hosts, dtype=args.dtype, cuda_graphs=args.cuda_graphs,
                           tensor_parallel_size=args.tensor_parallel_size,
                           gpus=tuple(g for g in (args.gpus or "").split(",") if g),
                           kv_events=args.failover,
                           extra_args=("--enable-prompt-tokens-details",
                                       "--served-model-name", "smollm2",
                                       *args.vllm_args.split()))
        t = time.perf_counter()
        with VllmCluster(spec) as cluster:
            startup_s = round(time.perf_counter() - t, 1)
            print(f"== cluster up in {startup_s} s", file=sys.stderr)
            model = "smollm2"
            d = cluster.decode[0]
            ref1 = token_ids(complete(d, model, p1, args.turn1_tokens))
            pd1 = pd_turn(cluster, model, p1, args.turn1_tokens, 0, 0)
            im_end = tok.token_id("<|im_end|>")
            closing = [] if ref1 and ref1[-1] == im_end else [im_end]
            p2 = p1 + ref1 + closing + list(tok.encode(
                f"\n<|im_start|>user\n{USER_2}<|im_end|>\n<|im_start|>assistant\n"))
            m = find_manifest(spec.store)
            store = BlockStore(spec.store, m.file_bytes, is_durable=False)
            keys = block_keys(p2, m.block_size, m.namespace_bytes)
            hit = m.hit_blocks(p2, store.contains)
            runs = {"recompute": pd_turn(cluster, model, p2, args.turn2_tokens, 0, 0),
                    "pe": pd_turn(cluster, model, p2, args.turn2_tokens, hit, hit),
                    "de": pd_turn(cluster, model, p2, args.turn2_tokens, hit, 0),
                    "split": pd_turn(cluster, model, p2, args.turn2_tokens, hit, 1)}
            victim = store.path_of(m.stored_key(keys[hit - 1]))  # the last rank's shard
            data = bytearray(victim.read_bytes())
            data[64 + 1000] ^= 0xFF
            victim.write_bytes(bytes(data))
            runs["de_corrupt"] = pd_turn(cluster, model, p2, args.turn2_tokens, hit, 0)
            rewritten = False  # the decode server writes it in the background: allow 10 s
            for _ in range(20):
                rewritten = store.get_into(m.stored_key(keys[hit - 1]),
                                           bytearray(store.full_block_bytes))
                if rewritten:
                    break
                time.sleep(0.5)
            n_pulls = sum(e["event"] == "pull" for e in cluster.prefill[0].events())
            routed = router_phase(cluster, spec.store, model)
            events = {i.name: i.events() for i in cluster.instances}
            tag = cluster.instances[0].tag.split(".")[0] + "."
            failover = None
            if args.failover:
                t = time.perf_counter()
                failover = failover_phase(cluster, spec.store, model,
                                          [[*p2, 100 + k] for k in range(NUM_PROMPTS)])
                failover["wall_s"] = round(time.perf_counter() - t, 1)
    shm = shm_left(tag)
    ref = runs["recompute"]["out"]
    pulls = [e for e in events["prefill0"] if e["event"] == "pull"]
    pushes = [e for e in events["prefill0"] if e["event"] == "push"]
    bs = m.block_size
    checks = {
        "turn 1 through P/D = turn 1 on one server": pd1["out"] == ref1,
        "turn 2 has stored blocks": hit >= 2,
        "PE path tokens = recompute": runs["pe"]["out"] == ref,
        "DE path tokens = recompute": runs["de"]["out"] == ref,
        "split tokens = recompute": runs["split"]["out"] == ref,
        "corrupt block recomputed, tokens = recompute": runs["de_corrupt"]["out"] == ref,
        "PE path: prefill server cached the hit": runs["pe"]["prefill_cached"] == hit * bs,
        "DE path: prefill server cached the hit": runs["de"]["prefill_cached"] == hit * bs,
        "recompute: nothing cached at prefill": runs["recompute"]["prefill_cached"] == 0,
        "decode server loaded all but one prompt token": all(
            r["decode_cached"] == len(p2) - 1 for r in runs.values()),
        "DE path pulled every hit block over NIXL": any(
            e["ok"] == hit and e["blocks"] == hit for e in pulls),
        "corrupt block: one pull stopped short": any(
            e["ok"] == hit - m.blocks_per_file for e in pulls),  # its file's blocks
        "corrupt block rewritten by the decode server": rewritten,
        "router: turn 2 through basic (PE) = through the DE path": (
            routed["reply2_basic"] == routed["reply2_de"] != ""),
        "router basic: every hit read on the PE side": (
            routed["stats_basic"]["hit_blocks_by_side"]["de"] == 0
            and routed["stats_basic"]["hit_blocks_by_side"]["pe"] >= 1),
        "router --force-read-side de: the hit read on the DE side": (
            routed["stats_de"]["requests_by_path"]["de"] == 1),
        "router: the DE path pulled over NIXL": any(
            e["ok"] >= 1 for e in pulls[n_pulls:]),
        "router dualpath: of two concurrent requests one took the DE path": (
            routed["stats_dual"]["requests_by_path"]["de"] >= 1
            and len(set(routed["replies_dual"])) == 1),
    }
    if failover is not None:
        checks.update(failover_checks(failover))
        checks["no shared memory of the cluster left"] = not shm
    summary = {"hosts": args.hosts, "startup_s": startup_s, "block_size": bs,
               "blocks_per_file": m.blocks_per_file,
               "turn1_prompt_tokens": len(p1),
               "turn2_prompt_tokens": len(p2), "hit_blocks": hit,
               "runs": {k: {x: v for x, v in r.items() if x != "out"} for k, r in runs.items()},
               "pulls": pulls, "pushes": pushes,
               "decode_events": [e for e in events["decode0"] if e["event"] != "save"][-8:],
               "turn2_text": tok.decode(ref), "router": routed, "failover": failover,
               "shm_left": shm, "checks": checks}
    print(json.dumps(summary, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
