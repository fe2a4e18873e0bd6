"""The router (`dualpath route`) at scale: up to 1,152 stand-in vLLM engines and the paper's
largest online load, measured on this machine.

Stand-ins: `tests/integrations/vllm/router/fake_instance.py` (the router tests' stand-in),
a node's worth of instances per process (one asyncio process serving many ports), half of
them prefill, half decode, each with a service time (`--prefill-ms`, `--decode-ms`: sleeps,
so a stand-in is an engine of unlimited batch). They publish the store's manifest as the
connectors do, a decode instance saves its prompt's full files (so the next turn hits), and
with `--reports push` each node's stand-ins push their state to the router
(`integrations.vllm.reports`); with `poll` the router polls every instance.

Load: agents replaying Table-2 trajectories (`dualpath.workload`, the 32K preset), each
turn's appended and generated lengths times `--token-scale`; turns arrive as a Poisson
process at the target rate, each the next turn of an agent whose previous turn has been
answered (a new agent starts when none is free), its prompt the agent's context so far
(token ids) plus the turn's appended ids. Per engine count and rate, after `--warmup-s`, for
`--duration-s`:

- sustained requests/s (answered in the window) against the offered rate;
- the router's added latency p50/p99: the client's latency minus the time the two stand-ins
  held the request (each stand-in measures it from its body read to its reply written);
- the router process's CPU-seconds per request (its /proc counters over the window);
- polling/state cost: the router's CPU-seconds per second with no requests, over
  `--idle-s`, and the polls and reports per second it handled;
- the scheduler's decision time: time in `RoutePolicy.schedule` per call and per request
  (the router's `/stats`).

A rate "holds" when at least 95% of the offered requests are answered in the window, with no
errors and an added p99 under `--max-p99-ms`; the rates go up until one does not. The table
prints as it goes; `router_scale.json` and `router_scale.png` (added latency against rate)
go to `--out` (default `$DUALPATH_OUT` or `./out`). The load generator, the stand-ins and the
router share this machine's cores: the router's CPU per request is its own, the added latency
is what it shows beside them.

    .venv/bin/python benchmarks/vllm/router_scale.py --engines 64,256,1152 \
        --rates 250,500,1000,1500
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dualpath.integrations.vllm.router.client import Pool, UpstreamError
from dualpath.workload.replay import scale_lengths
from dualpath.workload.synthetic import generate, preset
from dualpath.workload.trajectory import Trajectory

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "tests" / "integrations" / "vllm" / "router" / "fake_instance.py"
ENGINES_PER_NODE = 8
NODES_PER_PROCESS = 8
"""Stand-in nodes served by one process (each node reports for itself)."""
NAMESPACE = "5c" * 16
BLOCK_SIZE = 16
BLOCKS_PER_FILE = 8
VOCAB = 50_000
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


# -- the load: agents replaying trajectories ------------------------------------------------------
@dataclass
class Agent:
    trajectory: Trajectory
    rng: random.Random
    context: list[int] = field(default_factory=list)
    turn: int = 0


@dataclass
class Sample:
    sent_at: float
    latency_s: float
    standin_s: float
    status: int
    prompt_tokens: int


class Load:
    """Turns at a Poisson rate, each the next turn of a free agent."""

    def __init__(self, client: Pool, trajectories: list[Trajectory], seed: int) -> None:
        self.client = client
        self.trajectories = trajectories
        self.rng = random.Random(seed)
        self.free: list[Agent] = []
        self.num_agents = 0
        self.samples: list[Sample] = []
        self.in_flight = 0

    def _agent(self) -> Agent:
        if self.free:
            return self.free.pop()
        k = self.num_agents
        self.num_agents += 1
        return Agent(self.trajectories[k % len(self.trajectories)], random.Random(k))

    async def turn(self, agent: Agent) -> None:
        t = agent.trajectory
        append = [agent.rng.randrange(VOCAB) for _ in range(t.append_tokens[agent.turn])]
        prompt = agent.context + append
        body = json.dumps({"model": "m", "prompt": prompt,
                           "max_tokens": t.gen_tokens[agent.turn]}).encode()
        self.in_flight += 1
        began = time.perf_counter()
        try:
            reply = await self.client.request("POST", "/v1/completions", body)
            status, data = reply.status, reply.body
        except UpstreamError as e:
            status, data = 599, str(e).encode()
        finally:
            self.in_flight -= 1
        latency = time.perf_counter() - began
        standin_s = 0.0
        if status == 200:
            reply = json.loads(data)
            standin_s = reply.get("standin_us", 0.0) / 1e6
            agent.context = prompt + reply["choices"][0].get("token_ids", [])
            agent.turn += 1
        self.samples.append(Sample(began, latency, standin_s, status, len(prompt)))
        if status == 200 and agent.turn < t.num_turns:
            self.free.append(agent)

    async def run(self, rate: float, duration_s: float) -> int:
        """Offer turns at `rate` per second for `duration_s`; returns how many were sent."""
        tasks: set[asyncio.Task[None]] = set()
        start = time.perf_counter()
        next_at = start
        num = 0
        while True:
            now = time.perf_counter()
            if now - start >= duration_s:
                break
            while next_at <= now:
                task = asyncio.create_task(self.turn(self._agent()))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                num += 1
                next_at += self.rng.expovariate(rate)
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        return num

    async def drain(self, timeout_s: float) -> None:
        deadline = time.perf_counter() + timeout_s
        while self.in_flight and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)


# -- the processes --------------------------------------------------------------------------------
@dataclass
class Cluster:
    """The stand-in processes and the router over them."""

    engines: int
    prefill: list[str]
    decode: list[str]
    sides: list[str]
    nodes: list[int]
    procs: list[subprocess.Popen[bytes]]
    router: subprocess.Popen[str] | None = None
    router_url: str = ""


def free_ports(n: int) -> list[int]:
    import socket
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@contextlib.contextmanager
def cluster(args: argparse.Namespace, engines: int, store: Path) -> Iterator[Cluster]:
    """`engines` stand-ins (half prefill, half decode) in processes of `ENGINES_PER_NODE`
    ports (one node each; a node holds one role), and the router over them; with `--reports
    push` each process reports its node to the router."""
    num_nodes = engines // ENGINES_PER_NODE
    half = num_nodes // 2
    # A process serves nodes of one role: the prefill nodes' processes, then the decode ones'.
    groups = [list(range(a, min(a + NODES_PER_PROCESS, b)))
              for a0, b in ((0, half), (half, num_nodes))
              for a in range(a0, b, NODES_PER_PROCESS)]
    procs: list[subprocess.Popen[bytes]] = []
    urls: list[list[str]] = []
    c = Cluster(engines, [], [], [], [], procs)
    router_port = free_ports(1)[0]
    try:
        for nodes in groups:
            n = nodes[0]
            cmd = [sys.executable, str(STANDIN), "--ports",
                   str(ENGINES_PER_NODE * len(nodes)), "--node-size", str(ENGINES_PER_NODE),
                   "--prefill-ms", str(args.prefill_ms), "--decode-ms", str(args.decode_ms),
                   "--store", str(store), "--namespace", NAMESPACE,
                   "--block-size", str(BLOCK_SIZE), "--blocks-per-file", str(BLOCKS_PER_FILE),
                   "--kv-blocks", str(args.kv_blocks)]
            if args.reports == "push":
                cmd += ["--report-to", f"http://127.0.0.1:{router_port}", "--node", f"p{n}",
                        "--report-interval", str(args.poll_interval)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE))
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line:
                raise RuntimeError("a stand-in process exited before it served")
            urls.append([f"http://127.0.0.1:{port}" for port in json.loads(line)])
        for nodes, proc_urls in zip(groups, urls, strict=True):
            (c.prefill if nodes[0] < half else c.decode).extend(proc_urls)
            c.nodes.extend(n for n in nodes for _ in range(ENGINES_PER_NODE))
        c.sides = [f"127.0.0.1:{p}" for p in free_ports(len(c.decode))]
        start_router(args, c, store, router_port)
        yield c
    finally:
        if c.router is not None and c.router.poll() is None:
            c.router.send_signal(signal.SIGINT)
            try:
                c.router.wait(20)
            except subprocess.TimeoutExpired:
                c.router.kill()
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


PROFILED = """import cProfile, sys, time
from dualpath.cli.main import main
sys.argv = ["dualpath", *sys.argv[1:]]
p = cProfile.Profile(time.process_time)
p.enable()
try:
    main()
finally:
    p.disable()
    p.dump_stats({out!r})
"""


def start_router(args: argparse.Namespace, c: Cluster, store: Path, port: int) -> None:
    lines = [{"role": "prefill", "url": url, "node": f"n{node}"}
             for url, node in zip(c.prefill, c.nodes, strict=False)]
    lines += [{"role": "decode", "url": url, "side": side, "node": f"n{node}"}
              for url, side, node in zip(c.decode, c.sides, c.nodes[len(c.prefill):],
                                         strict=True)]
    instances = store / "instances.jsonl"
    instances.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cmd = [sys.executable, "-m", "dualpath.cli.main", "route", "--store", str(store),
           "--port", str(port), "--poll-interval", str(args.poll_interval), "--mode",
           args.mode, "--queue-timeout", "30", "--instances", str(instances)]
    if args.profile:  # CPU time, not wall time: this machine's cores are shared
        out = Path(args.out) / f"router_{c.engines}.prof"
        cmd = [sys.executable, "-c", PROFILED.format(out=str(out)), *cmd[3:]]
    # Its log to a file: a pipe nobody reads would stop it once full.
    log = Path(args.out) / f"router_{c.engines}.log"
    with log.open("w") as f:
        c.router = subprocess.Popen(cmd, stderr=f, text=True)
    c.router_url = f"http://127.0.0.1:{port}"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def stats_of(client: Pool) -> dict[str, Any]:
    reply = await client.request("GET", "/stats")
    if reply.status != 200:
        raise RuntimeError(f"/stats answered {reply.status}")
    out: dict[str, Any] = reply.json()
    return out


async def wait_healthy(client: Pool, timeout_s: float) -> None:
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        with contextlib.suppress(UpstreamError):
            reply = await client.request("GET", "/health", timeout_s=5)
            if reply.status == 200 and reply.json()["status"] == "ok":
                return
        await asyncio.sleep(0.2)
    raise RuntimeError("the router did not report every instance up in time")


async def measure(args: argparse.Namespace, c: Cluster,
                  trajectories: list[Trajectory]) -> list[dict[str, Any]]:
    assert c.router is not None
    client = Pool(c.router_url, connect_timeout_s=10, read_timeout_s=120, max_idle=4096)
    await wait_healthy(client, 60 + c.engines / 10)
    pid = c.router.pid
    # Idle: the cost of keeping the instances' state, with no request.
    s0, cpu0, t0 = await stats_of(client), cpu_s(pid), time.perf_counter()
    await asyncio.sleep(args.idle_s)
    s1, cpu1, t1 = await stats_of(client), cpu_s(pid), time.perf_counter()
    idle = {"idle_cpu_s_per_s": (cpu1 - cpu0) / (t1 - t0),
            "polls_per_s": (s1["polls"] - s0["polls"]) / (t1 - t0),
            "reports_per_s": (s1.get("reports", 0) - s0.get("reports", 0)) / (t1 - t0)}
    print(f"engines {c.engines}: idle router {idle['idle_cpu_s_per_s']:.3f} CPU-s/s, "
          f"{idle['polls_per_s']:.0f} polls/s, {idle['reports_per_s']:.0f} reports/s",
          flush=True)
    rows = []
    load = Load(client, trajectories, args.seed)
    for rate in args.rates:
        await load.run(rate, args.warmup_s)
        load.samples.clear()
        s0, cpu0, t0 = await stats_of(client), cpu_s(pid), time.perf_counter()
        sent = await load.run(rate, args.duration_s)
        s1, cpu1, t1 = await stats_of(client), cpu_s(pid), time.perf_counter()
        window = t1 - t0
        done = [x for x in load.samples if x.sent_at >= t0 - 1e-9]
        ok = [x for x in done if x.status == 200]
        added_ms = [(x.latency_s - x.standin_s) * 1e3 for x in ok]
        num_done = s1["finished"] - s0["finished"]
        calls = s1["schedule_calls"] - s0["schedule_calls"]
        sched_s = s1["schedule_seconds"] - s0["schedule_seconds"]
        row = {
            "engines": c.engines, "rate": rate, "offered_per_s": sent / window,
            "sustained_per_s": len(ok) / window, "errors": len(done) - len(ok),
            "added_p50_ms": percentile(added_ms, 0.5), "added_p99_ms": percentile(added_ms, 0.99),
            "router_cpu_ms_per_request": (cpu1 - cpu0) * 1e3 / max(1, num_done),
            "router_cpu_s_per_s": (cpu1 - cpu0) / window,
            "schedule_us_per_call": sched_s * 1e6 / max(1, calls),
            "schedule_us_per_request": sched_s * 1e6 / max(1, num_done),
            "mean_prompt_tokens": statistics.mean(x.prompt_tokens for x in ok) if ok else 0,
            "agents": load.num_agents, "loadavg_1m": os.getloadavg()[0], **idle,
        }
        row["holds"] = (row["sustained_per_s"] >= 0.95 * row["offered_per_s"]
                        and row["errors"] == 0 and row["added_p99_ms"] < args.max_p99_ms)
        rows.append(row)
        print(format_row(row), flush=True)
        await load.drain(30)
        if not row["holds"]:
            break
    client.close()
    return rows


HEADER = (f"{'engines':>7} {'rate':>6} {'offered':>8} {'sustained':>9} {'err':>4} "
          f"{'p50 ms':>7} {'p99 ms':>7} {'cpu ms/req':>10} {'cpu s/s':>7} "
          f"{'sched us/call':>13} {'sched us/req':>12} {'prompt':>6} {'holds':>5} "
          f"{'load':>5}")


def format_row(r: dict[str, Any]) -> str:
    return (f"{r['engines']:>7} {r['rate']:>6.0f} {r['offered_per_s']:>8.0f} "
            f"{r['sustained_per_s']:>9.0f} {r['errors']:>4} {r['added_p50_ms']:>7.2f} "
            f"{r['added_p99_ms']:>7.2f} {r['router_cpu_ms_per_request']:>10.3f} "
            f"{r['router_cpu_s_per_s']:>7.2f} {r['schedule_us_per_call']:>13.1f} "
            f"{r['schedule_us_per_request']:>12.1f} {r['mean_prompt_tokens']:>6.0f} "
            f"{'yes' if r['holds'] else 'NO':>5} {r['loadavg_1m']:>5.1f}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in sorted({r["engines"] for r in rows}):
        mine = [r for r in rows if r["engines"] == n]
        xs = [r["sustained_per_s"] for r in mine]
        ax.plot(xs, [r["added_p50_ms"] for r in mine], "o--", label=f"{n} engines, p50")
        ax.plot(xs, [r["added_p99_ms"] for r in mine], "s-", label=f"{n} engines, p99")
    ax.axhline(5.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("sustained requests/s")
    ax.set_ylabel("router's added latency (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("dualpath route over stand-in engines")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def trajectories_of(scale: float, seed: int) -> list[Trajectory]:
    return [scale_lengths(t, scale, scale) for t in generate(preset("32k"), seed)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="64,256,1152",
                    help="engine counts, comma-separated (multiples of 16)")
    ap.add_argument("--rates", default="250,500,1000,1500,2000",
                    help="request rates per second, comma-separated, rising")
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--token-scale", type=float, default=1 / 32,
                    help="each turn's appended and generated tokens times this")
    ap.add_argument("--prefill-ms", type=float, default=20.0)
    ap.add_argument("--decode-ms", type=float, default=100.0)
    ap.add_argument("--kv-blocks", type=int, default=1_000_000,
                    help="each stand-in's KV capacity in blocks (shown on /metrics)")
    ap.add_argument("--poll-interval", type=float, default=0.5,
                    help="the router's poll interval, and the nodes' report interval")
    ap.add_argument("--reports", choices=("push", "poll"), default="push",
                    help="push: each stand-in node reports to the router; poll: the router "
                    "polls every instance (plain vLLM instances)")
    ap.add_argument("--mode", default="dualpath", choices=("basic", "dualpath", "split"))
    ap.add_argument("--max-p99-ms", type=float, default=1000.0,
                    help="a rate holds only with an added p99 under this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="run the router under cProfile "
                    "(router_<engines>.prof in --out)")
    ap.add_argument("--out", default=os.environ.get("DUALPATH_OUT", "out"))
    args = ap.parse_args()
    try:
        engines = [int(x) for x in args.engines.split(",")]
        args.rates = [float(x) for x in args.rates.split(",")]
    except ValueError:
        sys.exit("router_scale: --engines and --rates must be comma-separated numbers")
    for n in engines:
        if n < 2 * ENGINES_PER_NODE or n % (2 * ENGINES_PER_NODE):
            sys.exit(f"router_scale: --engines {n}: must be a multiple of "
                     f"{2 * ENGINES_PER_NODE} (nodes of {ENGINES_PER_NODE}, half prefill)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trajectories = trajectories_of(args.token_scale, args.seed)
    print(HEADER, flush=True)
    rows: list[dict[str, Any]] = []
    for n in engines:
        with tempfile.TemporaryDirectory(prefix="router_scale_") as tmp, \
                cluster(args, n, Path(tmp)) as c:
            rows += asyncio.run(measure(args, c, trajectories))
    (out / "router_scale.json").write_text(json.dumps(
        {"args": {k: v for k, v in vars(args).items()}, "rows": rows}, indent=1) + "\n")
    plot(rows, out / "router_scale.png")
    print(f"wrote {out / 'router_scale.json'} and {out / 'router_scale.png'}")


if __name__ == "__main__":
    main()
