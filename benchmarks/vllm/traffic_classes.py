"""Traffic isolation on emulated hosts' links: does a latency-sensitive flow keep its latency
while a KV stream saturates the same link, and does KV still take the idle bandwidth?

    sudo nice python benchmarks/vllm/traffic_classes.py [--rate-mbit 200] [--repeats 3]
        [--seconds 6] [--out out/traffic_classes.json]

Two emulated hosts (network namespaces on a bridge, `netns.Hosts`). Host A's link (`eth0`
transmit) is an HTB of `--rate-mbit` (`transport.link_classes`), either one FIFO class for all
(`shared`, the baseline) or two classes, the high one served first with 99% guaranteed and the
low one 1%, each borrowing up to the link (`isolated`). Over it, at the same time:

- the KV stream: host B's NIXL agent READs from host A's in a loop (2 batches of 1 MiB in
  flight), both over UCX's TCP transport with the KV traffic class (`KVTrafficClass`:
  listening ports 20000-20015, which the link puts in the low class);
- the collective stand-in: host A sends 256-byte UDP messages marked with the collectives'
  DSCP (as `NCCL_IB_TC` marks them on RoCE) every 2 ms to an echo on host B, and times each
  round trip.

Rows: the stand-in alone on the link (`idle`), then `shared` and `isolated`, each repeated
(the order alternates), medians of the stand-in's p50/p99 round trip and of the KV stream's
throughput over the measured window. Emulated links on a shared 2-core machine: the
absolute numbers are this machine's, the contrast is the result.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from dualpath.integrations.vllm.cluster import netns
from dualpath.transport.link_classes import LinkClasses, clear, sent_bytes
from dualpath.transport.traffic_class import KVTrafficClass

KV = KVTrafficClass(traffic_class=72, tcp_ports=(20000, 20015))
COLLECTIVE_TOS = 104
"""DSCP 26: the collectives' class (high)."""
ECHO_PORT = 9999
BUFFER_BYTES = 64 << 20
BATCH_BYTES = 1 << 20
IN_FLIGHT = 2
"""Enough to keep the link busy through a full FIFO's queueing delay, little enough that
batches finishing together barely skew the window's count."""
PROBE_BYTES = 256
PROBE_INTERVAL_S = 0.002
WARMUP_S = 2.0


# ---- roles, each run inside an emulated host -----------------------------------------------

def role_target(folder: Path) -> None:
    """Host A: the KV agent whose memory host B reads; serves until its stdin closes."""
    import numpy as np

    from dualpath.transport.nixl import NixlAgent, agent_name

    agent = NixlAgent(agent_name("kvsrc"), progress_thread=True, traffic_class=KV)
    buf = np.ones(BUFFER_BYTES, np.uint8)
    agent.register([(buf.ctypes.data, buf.nbytes)])
    (folder / "target.meta").write_bytes(agent.metadata())
    (folder / "target.addr").write_text(str(buf.ctypes.data))
    sys.stdin.read()
    agent.close()


def role_echo() -> None:
    """Host B: send every UDP message back, marked as it came (the collectives' class)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, COLLECTIVE_TOS)
    s.bind(("0.0.0.0", ECHO_PORT))
    while True:
        data, peer = s.recvfrom(2048)
        s.sendto(data, peer)


def _window() -> tuple[float, float]:
    """Say "ready" and read the measured window from stdin: two monotonic times (the clock
    the namespaces share)."""
    print("ready", flush=True)
    start_at, end_at = map(float, sys.stdin.readline().split())
    return start_at, end_at


def role_reader(folder: Path) -> None:
    """Host B: READ host A's buffer in a loop, IN_FLIGHT batches at a time, from before the
    window to its end; prints the bytes of the batches that completed inside it after the
    first one, and the time from that one to the last."""
    from collections import deque

    import numpy as np

    from dualpath.transport.nixl import NixlAgent, Pending, agent_name

    agent = NixlAgent(agent_name("kvdst"), progress_thread=False, traffic_class=KV)
    here = np.zeros(IN_FLIGHT * BATCH_BYTES, np.uint8)
    agent.register([(here.ctypes.data, here.nbytes)])
    peer = agent.connect((folder / "target.meta").read_bytes())
    there = int((folder / "target.addr").read_text())
    slots = BUFFER_BYTES // BATCH_BYTES
    pending: deque[Pending] = deque()
    agent.transfer("READ", peer, [(here.ctypes.data, there, BATCH_BYTES)])  # connected
    start_at, end_at = _window()
    done_at: list[float] = []  # completions inside the window
    n = 0
    while time.monotonic() < end_at:
        while len(pending) < IN_FLIGHT:
            local = here.ctypes.data + (n % IN_FLIGHT) * BATCH_BYTES
            p = agent.post("READ", peer, [(local, there + (n % slots) * BATCH_BYTES,
                                           BATCH_BYTES)])
            assert p is not None
            pending.append(p)
            n += 1
        pending.popleft().wait(60.0)
        now = time.monotonic()
        if start_at <= now <= end_at:
            done_at.append(now)
    for p in pending:
        p.wait(60.0)
    # Between the first and the last completion in the window: whole batches only, none
    # counted for the bytes that moved before the window.
    print(json.dumps({"kv_bytes": BATCH_BYTES * max(0, len(done_at) - 1),
                      "window_s": done_at[-1] - done_at[0] if len(done_at) > 1 else 1.0}),
          flush=True)
    agent.close()


def role_prober(peer: str) -> None:
    """Host A: a message every PROBE_INTERVAL_S to host B's echo from the window's start
    minus the warm-up to its end; prints the round trips of those sent inside the window
    (seconds) and how many never came back."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, COLLECTIVE_TOS)
    start_at, end_at = _window()
    sent: dict[int, float] = {}
    rtts: list[float] = []
    done = threading.Event()

    def receive() -> None:
        s.settimeout(0.2)
        while not done.is_set():
            try:
                data = s.recv(2048)
            except TimeoutError:
                continue
            now = time.monotonic()
            at = sent.get(int.from_bytes(data[:8], "little"))
            if at is not None and start_at <= at <= end_at:
                rtts.append(now - at)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    seq = 0
    next_at = start_at - WARMUP_S
    while next_at < end_at:
        time.sleep(max(0.0, next_at - time.monotonic()))
        now = time.monotonic()
        sent[seq] = now
        s.sendto(seq.to_bytes(8, "little") + bytes(PROBE_BYTES - 8), (peer, ECHO_PORT))
        seq += 1
        next_at += PROBE_INTERVAL_S
    time.sleep(1.0)  # the last replies
    done.set()
    thread.join()
    measured = sum(1 for t in sent.values() if start_at <= t <= end_at)
    print(json.dumps({"rtts_s": rtts, "sent": measured}), flush=True)


# ---- the driver, in the root namespace -----------------------------------------------------

def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _last_json(out: str) -> dict[str, Any]:
    return dict(json.loads(next(x for x in reversed(out.splitlines()) if x.startswith("{"))))


def _role(host: netns.Host, *args: str) -> list[str]:
    return host.command(["nice", sys.executable, __file__, "--role", *args])


def trial(hosts: netns.Hosts, folder: Path, mode: str, rate_mbit: float,
          seconds: float) -> dict[str, Any]:
    a, b = hosts.hosts
    LinkClasses(rate_mbit, KV, isolated=mode == "isolated").apply("eth0", a.netns)
    before = sent_bytes("eth0", a.netns)
    env = {**os.environ, **netns.HOST_ENV}
    procs = [subprocess.Popen(_role(a, "prober", b.address), env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)]
    if mode != "idle":
        procs.append(subprocess.Popen(_role(b, "reader", str(folder)), env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for p in procs:  # started and connected: the window is the same for all (UCX may log
        assert p.stdout is not None  # to stdout before)
        line = "-"
        while line and line.strip() != "ready":
            line = p.stdout.readline()
        if not line:
            sys.exit(f"traffic_classes: a {mode} trial's process failed to start")
    start_at = time.monotonic() + WARMUP_S
    end_at = start_at + seconds
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(f"{start_at!r} {end_at!r}\n")
        p.stdin.flush()
    time.sleep(max(0.0, start_at - time.monotonic()))
    at_start = sent_bytes("eth0", a.netns)
    time.sleep(max(0.0, end_at - time.monotonic()))
    at_end = sent_bytes("eth0", a.netns)
    outs = [p.communicate(timeout=seconds + 120)[0] for p in procs]
    probe = _last_json(outs[0])
    kv = _last_json(outs[1]) if len(outs) > 1 else {"kv_bytes": 0, "window_s": seconds}
    after = sent_bytes("eth0", a.netns)
    rtts = probe["rtts_s"]
    return {"mode": mode, "rtt_p50_ms": 1e3 * _percentile(rtts, 0.5),
            "rtt_p99_ms": 1e3 * _percentile(rtts, 0.99), "probes": probe["sent"],
            "lost": probe["sent"] - len(rtts),
            "kv_mbit_per_s": kv["kv_bytes"] * 8 / kv["window_s"] / 1e6,
            "link_mbit_per_s": (at_end["1:1"] - at_start["1:1"]) * 8 / seconds / 1e6,
            "class_bytes": {k: after.get(k, 0) - before.get(k, 0) for k in after}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate-mbit", type=float, default=200.0, help="the emulated link's rate")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0, help="measured window per trial")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("DUALPATH_OUT", "out"))
                    / "traffic_classes.json")
    args = ap.parse_args()
    why = netns.available()
    if why:
        sys.exit(f"traffic_classes: emulated hosts unavailable: {why}")
    runs: list[dict[str, Any]] = []
    with netns.Hosts() as hosts, tempfile.TemporaryDirectory(prefix="dp-tc-") as tmp:
        a, b = hosts.add(), hosts.add()
        folder = Path(tmp)
        env = {**os.environ, **netns.HOST_ENV}
        target = subprocess.Popen(_role(a, "target", str(folder)), env=env,
                                  stdin=subprocess.PIPE)
        echo = subprocess.Popen(_role(b, "echo"), env=env)
        try:
            deadline = time.monotonic() + 60
            while not (folder / "target.addr").exists():
                if time.monotonic() > deadline or target.poll() is not None:
                    sys.exit("traffic_classes: the KV target did not start")
                time.sleep(0.2)
            order = ["idle"] + [m for i in range(args.repeats)
                                for m in (("shared", "isolated") if i % 2 == 0
                                          else ("isolated", "shared"))]
            for mode in order:
                run = trial(hosts, folder, mode, args.rate_mbit, args.seconds)
                runs.append(run)
                print(f"{mode:9s} p50 {run['rtt_p50_ms']:7.3f} ms  p99 "
                      f"{run['rtt_p99_ms']:7.3f} ms  lost {run['lost']:3d}/{run['probes']}  "
                      f"KV {run['kv_mbit_per_s']:6.1f} Mb/s  link {run['link_mbit_per_s']:6.1f} "
                      f"Mb/s  {run['class_bytes']}",
                      flush=True)
        finally:
            assert target.stdin is not None
            target.stdin.close()
            echo.kill()
            for p in (target, echo):
                p.wait(30)
            clear("eth0", a.netns)
    table = []
    for mode in ("idle", "shared", "isolated"):
        rows = [r for r in runs if r["mode"] == mode]
        table.append({"mode": mode, "n": len(rows),
                      **{k: statistics.median(r[k] for r in rows)
                         for k in ("rtt_p50_ms", "rtt_p99_ms", "kv_mbit_per_s",
                                   "link_mbit_per_s", "lost")}})
    print(f"\nlink {args.rate_mbit:g} Mb/s, medians over {args.repeats} repeats "
          f"({args.seconds:g} s windows):")
    print("| link | stand-in p50 (ms) | stand-in p99 (ms) | lost | KV stream (Mb/s) | "
          "link sent (Mb/s) |")
    print("|---|---|---|---|---|---|")
    for row in table:
        print(f"| {row['mode']} | {row['rtt_p50_ms']:.3f} | {row['rtt_p99_ms']:.3f} | "
              f"{row['lost']:g} | {row['kv_mbit_per_s']:.1f} | {row['link_mbit_per_s']:.1f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rate_mbit": args.rate_mbit, "seconds": args.seconds,
                                    "runs": runs, "table": table}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--role":
        role, rest = sys.argv[2], sys.argv[3:]
        if role == "target":
            role_target(Path(rest[0]))
        elif role == "echo":
            role_echo()
        elif role == "reader":
            role_reader(Path(rest[0]))
        elif role == "prober":
            role_prober(rest[0])
    else:
        main()
