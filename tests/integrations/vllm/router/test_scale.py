"""The router over hundreds of stand-in engines grouped in nodes that push their state
(`fake_instance.py --report-to`, one process per node): whole nodes SIGKILLed under load,
and the router itself SIGKILLed and restarted on its port."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2
from fake_instance import generated_ids
from fakes import FAKE, wait_until

from dualpath.integrations.vllm.cluster.ports import free_port
from dualpath.integrations.vllm.manifest import StoreManifest

NODES = 16
PER_NODE = 16
"""Engines (ports) per stand-in process: 256 engines, half prefill, half decode."""
INTERVAL_S = 0.2


class Node:
    """A stand-in process serving a node's engines and reporting them."""

    def __init__(self, name: str, router_port: int, store: Path, *flags: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, str(FAKE), "--ports", str(PER_NODE), "--report-to",
             f"http://127.0.0.1:{router_port}", "--node", name, "--report-interval",
             str(INTERVAL_S), "--store", str(store), "--block-size", "4", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert self.proc.stdout is not None
        self.urls = [f"http://127.0.0.1:{p}" for p in json.loads(self.proc.stdout.readline())]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


@contextmanager
def fleet(tmp: Path, router_port: int, *flags: str) -> Iterator[tuple[list[Node], Path]]:
    """The stand-in nodes (the first half prefill) and the instances file naming them."""
    store = tmp / "store"
    StoreManifest(namespace="ab" * 16, model="m", block_size=4,
                  full_block_bytes=64).write(store)
    nodes: list[Node] = []
    try:
        for n in range(NODES):
            nodes.append(Node(f"node{n}", router_port, store, *flags))
        lines = []
        for n, node in enumerate(nodes):
            for url in node.urls:
                line: dict[str, Any] = {"role": "prefill" if n < NODES // 2 else "decode",
                                        "url": url, "node": node.name}
                if n >= NODES // 2:
                    line["side"] = f"127.0.0.1:{5600 + len(lines)}"
                lines.append(line)
        instances = tmp / "instances.jsonl"
        instances.write_text("".join(json.dumps(x) + "\n" for x in lines))
        yield nodes, instances
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                node.kill()


class Router:
    """`dualpath route` in a process of its own (so a test can SIGKILL it)."""

    def __init__(self, port: int, store: Path, instances: Path) -> None:
        self.port = port
        self.cmd = [sys.executable, "-m", "dualpath.cli.main", "route", "--store", str(store),
                    "--instances", str(instances), "--port", str(port), "--poll-interval",
                    str(INTERVAL_S), "--queue-timeout", "20"]
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stderr=subprocess.DEVNULL)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = httpx2.get(self.url + "/stats", timeout=10).json()
        return out

    def answers(self) -> bool:
        try:
            return httpx2.get(self.url + "/health", timeout=1).status_code in (200, 503)
        except httpx2.HTTPError:
            return False

    def is_reported(self, num: int) -> bool:
        try:
            s = self.stats()
        except httpx2.HTTPError:
            return False
        return bool(s["reporting_instances"] == num and s["health"] == "ok")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


def complete(client: httpx2.Client, k: int) -> tuple[int, str]:
    prompt = [k % 50_000 + 1] * 40
    try:
        resp = client.post("/v1/completions", json={"model": "m", "prompt": prompt,
                                                     "max_tokens": 3})
    except httpx2.HTTPError as e:
        return 599, type(e).__name__
    if resp.status_code != 200:
        return resp.status_code, resp.text[:200]
    ids = resp.json()["choices"][0]["token_ids"]
    return 200, "ok" if ids == generated_ids(prompt, 3) else f"wrong ids {ids}"


def test_whole_nodes_killed_among_hundreds_of_engines_under_load(tmp_path: Path) -> None:
    port = free_port()
    with fleet(tmp_path, port, "--prefill-ms", "20", "--decode-ms", "60") as (nodes, inst):
        router = Router(port, tmp_path / "store", inst)
        try:
            wait_until(lambda: router.is_reported(NODES * PER_NODE), timeout_s=120)
            polls = router.stats()["polls"]
            time.sleep(1.0)
            assert router.stats()["polls"] == polls  # reported engines are not polled
            with httpx2.Client(base_url=router.url, timeout=30) as client, \
                    ThreadPoolExecutor(16) as pool:
                first = list(pool.map(lambda k: complete(client, k), range(100)))
                # A prefill node and a decode node die mid-load.
                pending = [pool.submit(complete, client, k) for k in range(100, 500)]
                time.sleep(0.5)
                dead = [nodes[1], nodes[NODES // 2 + 1]]
                for node in dead:
                    node.kill()
                rest = [f.result() for f in pending]
                after = list(pool.map(lambda k: complete(client, k), range(500, 600)))
            assert first == [(200, "ok")] * 100
            assert rest == [(200, "ok")] * 400, [r for r in rest if r[0] != 200][:5]
            assert after == [(200, "ok")] * 100
            s = router.stats()
            gone = {u for node in dead for u in node.urls}
            down = {i["url"] for role in ("prefill", "decode") for i in s[role] if not i["up"]}
            assert down == gone
            assert s["health"] == "degraded" and s["aborted"] == 0 and s["retries"] >= 1
            assert s["reporting_instances"] == (NODES - 2) * PER_NODE
        finally:
            router.close()


def test_a_router_killed_under_load_rebuilds_its_state_from_the_reports(
        tmp_path: Path) -> None:
    port = free_port()
    with fleet(tmp_path, port, "--prefill-ms", "50", "--decode-ms", "2000") as (nodes, inst):
        router = Router(port, tmp_path / "store", inst)
        try:
            wait_until(lambda: router.is_reported(NODES * PER_NODE), timeout_s=120)
            with httpx2.Client(base_url=router.url, timeout=30) as client, \
                    ThreadPoolExecutor(32) as pool:
                in_flight = [pool.submit(complete, client, k) for k in range(32)]
                # Requests in service at their decode instances, then the router dies.
                wait_until(lambda: sum((i["metrics"] or {}).get("running") or 0
                                       for i in router.stats()["decode"]) == 32)
                router.kill()
                failed = [f.result() for f in in_flight]
                router.start()
                wait_until(router.answers, timeout_s=60)
                serving_at = time.monotonic()
                wait_until(lambda: router.is_reported(NODES * PER_NODE), timeout_s=60)
                rebuilt_s = time.monotonic() - serving_at
                # Every engine is known again from the reports alone: up, and no engine
                # still serves a request of the dead router's (dropped when the router's
                # connections closed).
                wait_until(lambda: all((i["metrics"] or {}).get("running") == 0
                                       for i in router.stats()["decode"]), timeout_s=10)
                after = list(pool.map(lambda k: complete(client, k), range(100, 132)))
            assert all(status != 200 for status, _ in failed)
            assert after == [(200, "ok")] * 32
            # Reports every INTERVAL_S: every engine is known again about one interval after
            # the restarted router answers.
            print(f"state rebuilt {rebuilt_s:.2f} s after the restarted router answered")
            assert rebuilt_s < 10 * INTERVAL_S, rebuilt_s
            assert router.stats()["health"] == "ok"
        finally:
            router.close()
