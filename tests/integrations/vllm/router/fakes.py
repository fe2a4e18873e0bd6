"""Handles on stand-in vLLM instances in processes of their own (`fake_instance.py`) and a
router over them, for the router's tests (failover, usage); `conftest.py` makes the fixtures."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx2

from dualpath.http.server import HttpServer, ServerConfig
from dualpath.integrations.vllm.cluster.ports import free_port
from dualpath.integrations.vllm.manifest import StoreManifest
from dualpath.integrations.vllm.router.app import make_app
from dualpath.integrations.vllm.router.config import RouterConfig
from dualpath.integrations.vllm.router.policy import route_params
from dualpath.integrations.vllm.router.router import Router

FAKE = Path(__file__).with_name("fake_instance.py")

BS = 4
BLOCK_BYTES = 64
WAIT_S = 10.0
PROMPT = "abcdefghijklmnopq"


def wait_until(condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met in {timeout_s} s")
        time.sleep(0.01)


class Fake:
    """One `fake_instance.py` process on a port of its own (kept across restarts)."""

    def __init__(self, log: Path, hold: str | None = None, *flags: str) -> None:
        self.port = free_port()
        self.log = log
        self.flags = flags
        self.proc: subprocess.Popen[bytes] | None = None
        self.start(hold)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, hold: str | None = None) -> None:
        cmd = [sys.executable, str(FAKE), "--port", str(self.port), "--log", str(self.log),
               *self.flags]
        self.proc = subprocess.Popen(cmd + (["--hold", hold] if hold else []))
        wait_until(self.answers)

    def answers(self) -> bool:
        try:
            return httpx2.get(self.url + "/health", timeout=1.0).status_code == 200
        except httpx2.HTTPError:
            return False

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def records(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(x) for x in self.log.read_text().splitlines() if x]

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [r["body"] for r in self.records() if r.get("path") == path]

    def is_holding(self) -> bool:
        return any("hold" in r for r in self.records())

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


def side(j: int) -> str:
    return f"127.0.0.1:{5600 + j}"


@contextmanager
def routed(store: tuple[Path, StoreManifest], prefill: Sequence[Fake], decode: Sequence[Fake],
           mode: str = "dualpath", **cfg: Any) -> Iterator[httpx2.Client]:
    """A router over the fakes, served on loopback; yields a client of it."""
    root, manifest = store
    params, _ = route_params(mode, BS, BLOCK_BYTES / BS, alpha_tokens=1e9, beta_tokens=1e9)
    config = RouterConfig(prefill=tuple(f.url for f in prefill),
                          decode=tuple(f.url for f in decode),
                          sides=tuple(side(j) for j in range(len(decode))), store=root,
                          manifest=manifest, params=params, mode=mode,
                          **{"poll_interval_s": 0.05, **cfg})
    server = HttpServer(make_app(Router(config)), "127.0.0.1", 0,
                        ServerConfig(log_level="warning"))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    wait_until(lambda: server.is_started)
    with ExitStack() as stack:
        stack.callback(server.server_close)
        stack.callback(thread.join, WAIT_S)
        stack.callback(server.stop)
        client = stack.enter_context(httpx2.Client(base_url=server.url, timeout=WAIT_S))
        wait_until(lambda: client.get("/health").json()["status"] == "ok")
        yield client


def complete(client: httpx2.Client, prompt: str = PROMPT, **headers: str) -> httpx2.Response:
    return client.post("/v1/completions", json={"model": "m", "prompt": prompt,
                                                 "max_tokens": 4}, headers=headers)


def stats(client: httpx2.Client) -> dict[str, Any]:
    out: dict[str, Any] = client.get("/stats").json()
    return out
