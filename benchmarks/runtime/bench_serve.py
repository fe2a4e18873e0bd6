"""Serving agentic conversations through the OpenAI-compatible API: Basic vs DualPath.

Each mode gets its own `ServingEngine` (emulated 1P2D cluster, tiny model, node threads, the
I/O-bound NICs of `tests/runtime/test_run.py`: storage NIC 2 MiB/s per node, so reading a
1,000-token prefix of stored KV takes about half a second) and an HTTP server on loopback.
`--clients` client threads each hold one conversation over real HTTP: a first request with a
long prompt (token ids), then `--turns` follow-ups that append the previous reply and 20 new
tokens, so every follow-up's prompt is almost all stored KV (`cached_tokens`), which only the
prefill node's storage NIC reads in Basic and every node's in DualPath. Requests are streamed;
TTFT is measured by the client (request sent -> first content event).

Reported per mode (Basic, DualPath, and Oracle: storage and transfers unpaced), medians over
`--repeats` after a warm-up run: the wall time of all conversations, median client TTFT of the
follow-ups, the share of prompt tokens served from storage; and the ratios Basic / DualPath and
Oracle / DualPath of the wall times (same process, same run). Emulated hardware: the NIC rates
are software limits on this machine.

Last, the API's own cost: the same short greedy requests one at a time, through
`ServingEngine.generate` (the baseline) and through HTTP with SSE, in Oracle mode (no emulated
NIC paces them); medians and their ratio.

Run: `.venv/bin/python benchmarks/runtime/bench_serve.py` (about a minute and a half on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from dualpath.runtime.model.model_source import ModelSource, model_tokenizer
from dualpath.runtime.model.sampling import SamplingParams
from dualpath.runtime.run_config import RunConfig
from dualpath.serve import GenerateRequest, ServingEngine, make_server

MiB = 2**20
FIRST_PROMPT = 1000
APPEND = 20
GEN = 4


def stream(address: str, prompt: list[int]) -> tuple[list[int], float]:
    """One streamed completion: (reply token ids, seconds to the first content event)."""
    body = {"prompt": prompt, "max_tokens": GEN, "temperature": 0, "ignore_eos": True,
            "stream": True}
    req = urllib.request.Request(f"{address}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    sent = time.perf_counter()
    ttft = 0.0
    text = ""
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0]["text"]
            if piece and not ttft:
                ttft = time.perf_counter() - sent
            text += piece
    return _TOKENIZER.encode(text), ttft or time.perf_counter() - sent


_TOKENIZER = model_tokenizer(ModelSource("tiny"))


def conversation(address: str, client: int, turns: int) -> list[float]:
    """One client's conversation; the follow-ups' TTFTs."""
    prompt = [3 + (client * 37 + i) % 250 for i in range(FIRST_PROMPT)]
    ttfts = []
    for t in range(turns + 1):
        reply, ttft = stream(address, prompt)
        if t:
            ttfts.append(ttft)
        prompt = prompt + reply + [5 + (client + t + i) % 250 for i in range(APPEND)]
    return ttfts


def run_mode(mode: str, clients: int, turns: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix=f"bench-serve-{mode}-") as store:
        cfg = RunConfig(
            mode=mode, store_root=store, launch="thread", num_prefill_nodes=1,
            num_decode_nodes=2, engines_per_node=1, storage_nic_bytes_per_s=2 * MiB,
            compute_nic_bytes_per_s=16 * MiB, buffer_bytes=32 * MiB, hbm_bytes=64 * MiB,
            transfer_kind="shm",
        )
        with ServingEngine(cfg, _TOKENIZER, "tiny", request_timeout_s=300) as engine:
            server = make_server(engine, "127.0.0.1", 0, is_logging=False)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            host, port = server.server_address[:2]
            address = f"http://{host!s}:{port}"
            started = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                ttfts = [x for xs in pool.map(lambda c: conversation(address, c, turns),
                                              range(clients)) for x in xs]
            wall = time.perf_counter() - started
            server.shutdown()
            server.server_close()
            stats = engine.stats
            return {"wall_s": wall, "ttft_s": statistics.median(ttfts),
                    "cached": stats.num_cached_tokens / max(1, stats.num_prompt_tokens)}


def api_overhead(num_requests: int) -> dict[str, float]:
    """Per-request latency of the same short greedy requests (8 prompt tokens, 8 generated)
    submitted one at a time through `ServingEngine.generate` (the baseline) and through the
    HTTP API (JSON in, SSE out), in Oracle mode so no emulated NIC paces them: what HTTP,
    JSON and the event stream add to a request."""
    with tempfile.TemporaryDirectory(prefix="bench-serve-api-") as store:
        cfg = RunConfig(mode="oracle", store_root=store, launch="thread", num_prefill_nodes=1,
                        num_decode_nodes=1, engines_per_node=1, hbm_bytes=64 * MiB,
                        transfer_kind="shm")
        with ServingEngine(cfg, _TOKENIZER, "tiny", request_timeout_s=300) as engine:
            server = make_server(engine, "127.0.0.1", 0, is_logging=False)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            host, port = server.server_address[:2]
            address = f"http://{host!s}:{port}"
            prompts = [[3 + k, 4, 5, 6, 7, 8, 9, 10] for k in range(num_requests)]

            def direct(p: list[int]) -> float:
                t = time.perf_counter()
                # Streaming, as the API submits every request.
                engine.generate(GenerateRequest(
                    tuple(p), SamplingParams(max_tokens=GEN * 2, is_ignore_eos=True),
                    is_streaming=True)).result()
                return time.perf_counter() - t

            def http(p: list[int]) -> float:
                t = time.perf_counter()
                body = {"prompt": p, "max_tokens": GEN * 2, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                req = urllib.request.Request(f"{address}/v1/completions",
                                             data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=300) as r:
                    r.read()
                return time.perf_counter() - t

            direct(prompts[0])  # warm-up
            http(prompts[0])
            d = statistics.median(direct(p) for p in prompts)
            h = statistics.median(http(p) for p in prompts)
            server.shutdown()
            server.server_close()
            return {"direct_s": d, "http_s": h}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=6, help="concurrent conversations")
    ap.add_argument("--turns", type=int, default=2, help="follow-up turns per conversation")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--api-only", action="store_true", help="only the API's own cost")
    args = ap.parse_args()
    torch.set_num_threads(1)  # node threads share this process
    if args.api_only:
        report_api_overhead()
        return
    run_mode("dualpath", 2, 1)  # warm-up: first-touch memory, model build, HTTP stack
    results: dict[str, list[dict[str, float]]] = {"basic": [], "dualpath": [], "oracle": []}
    for _ in range(args.repeats):
        for mode in results:  # interleaved, so drift on this shared VM hits both alike
            results[mode].append(run_mode(mode, args.clients, args.turns))
    med: dict[str, dict[str, Any]] = {
        m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()
    }
    print(f"bench_serve: {args.clients} conversations x {args.turns + 1} turns over HTTP, "
          f"emulated 1P2D, tiny model, storage NIC 2 MiB/s (emulated); medians of "
          f"{args.repeats}")
    for m, r in med.items():
        print(f"  {m:<9} wall {r['wall_s']:6.2f} s   follow-up TTFT {r['ttft_s'] * 1e3:7.0f} ms"
              f"   prompt tokens from storage {r['cached']:.0%}")
    ratio = statistics.median(b["wall_s"] / d["wall_s"]
                              for b, d in zip(results["basic"], results["dualpath"], strict=True))
    print(f"  basic / dualpath wall time: {ratio:.2f}x (median of per-repeat ratios)")
    reach = statistics.median(o["wall_s"] / d["wall_s"]
                              for o, d in zip(results["oracle"], results["dualpath"], strict=True))
    print(f"  oracle / dualpath wall time: {reach:.2f} (DualPath reaches {reach:.0%} of the "
          "I/O-free oracle)")
    report_api_overhead()


def report_api_overhead() -> None:
    over = api_overhead(20)
    d_ms, h_ms = over["direct_s"] * 1e3, over["http_s"] * 1e3
    print(f"API overhead (oracle, 1P1D, one request at a time, medians of 20): {d_ms:.1f} ms "
          f"per request through ServingEngine.generate, {h_ms:.1f} ms through HTTP + SSE "
          f"({h_ms / d_ms:.2f}x, +{h_ms - d_ms:.1f} ms)")


if __name__ == "__main__":
    main()
