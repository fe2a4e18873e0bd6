"""The router's failover against stand-in vLLM instances in processes of their own
(`fake_instance.py`), killed with SIGKILL mid-request as a crashing server would be: an
instance marked down and excluded, its return, a request retried on another instance before
its first token, a stream that breaks after it, `/health`, the trace id."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx2
import pytest

from dualpath.http.server import HttpServer, ServerConfig
from dualpath.integrations.vllm.cluster.launch import free_port
from dualpath.integrations.vllm.manifest import RouteParams, StoreManifest
from dualpath.integrations.vllm.router.app import Router, RouterConfig, make_app
from dualpath.integrations.vllm.router.policy import route_params

FAKE = Path(__file__).with_name("fake_instance.py")
sys.path.insert(0, str(FAKE.parent))
from fake_instance import reply_text, stream_words  # noqa: E402

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

    def __init__(self, log: Path, hold: str | None = None) -> None:
        self.port = free_port()
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.start(hold)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, hold: str | None = None) -> None:
        cmd = [sys.executable, str(FAKE), "--port", str(self.port), "--log", str(self.log)]
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


@pytest.fixture()
def store(tmp_path: Path) -> tuple[Path, StoreManifest]:
    manifest = StoreManifest(namespace="ab" * 16, model="m", block_size=BS,
                             full_block_bytes=BLOCK_BYTES)
    root = tmp_path / "store"
    manifest.write(root)
    return root, manifest


@pytest.fixture()
def fakes(tmp_path: Path) -> Iterator[Callable[..., Fake]]:
    made: list[Fake] = []

    def make(hold: str | None = None) -> Fake:
        made.append(Fake(tmp_path / f"fake{len(made)}.jsonl", hold))
        return made[-1]

    try:
        yield make
    finally:
        for f in made:
            f.close()


def side(j: int) -> str:
    return f"127.0.0.1:{5600 + j}"


@contextmanager
def routed(store: tuple[Path, StoreManifest], prefill: Sequence[Fake], decode: Sequence[Fake],
           mode: str = "dualpath", **cfg: Any) -> Iterator[httpx2.Client]:
    """A router over the fakes, served on loopback; yields a client of it."""
    root, manifest = store
    params, rr = route_params(mode, BS, BLOCK_BYTES / BS, alpha_tokens=1e9, beta_tokens=1e9)
    config = RouterConfig(prefill=tuple(f.url for f in prefill),
                          decode=tuple(f.url for f in decode),
                          sides=tuple(side(j) for j in range(len(decode))), store=root,
                          manifest=manifest, params=params, mode=mode, is_round_robin=rr,
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


def test_a_dead_decode_is_marked_down_excluded_and_rejoins(
        store: tuple[Path, StoreManifest], fakes: Callable[..., Fake]) -> None:
    p, d0, d1 = fakes(), fakes(), fakes()
    # The default poll interval, 0.5 s: the instance is down well within 2 s.
    with routed(store, [p], [d0, d1], poll_interval_s=0.5) as client:
        d0.kill()
        wait_until(lambda: not stats(client)["decode"][0]["up"], timeout_s=2.0)
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        (down,) = health.json()["down"]
        assert down["url"] == d0.url and down["role"] == "decode"
        # dualpath sends an idle cluster's requests to decode 0 (ties: the lower id): none
        # goes there while it is down, none needs a retry.
        prompts = [PROMPT + str(k) for k in range(4)]
        for prompt in prompts:
            resp = complete(client, prompt)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == reply_text(prompt)
        assert len(d1.bodies("/v1/completions")) == 4
        assert {b["kv_transfer_params"]["dualpath"]["de"] for b in p.bodies(
            "/v1/completions")} == {side(1)}
        s = stats(client)
        assert s["retries"] == 0 and s["health"] == "degraded"
        assert 'dualpath_router:up{instance="' + d0.url + '"' in client.get("/metrics").text
        # It answers again (a restart on its port): it takes requests again.
        d0.start()
        wait_until(lambda: client.get("/health").json()["status"] == "ok")
        assert complete(client).status_code == 200
        assert len(d0.bodies("/v1/completions")) == 1


def test_with_its_only_decode_down_a_request_waits_for_the_restart(
        store: tuple[Path, StoreManifest], fakes: Callable[..., Fake]) -> None:
    p, d = fakes(), fakes()
    with routed(store, [p], [d]) as client, ThreadPoolExecutor(1) as pool:
        d.kill()
        wait_until(lambda: client.get("/health").status_code == 503)
        assert client.get("/health").json()["status"] == "unavailable"
        waiting = pool.submit(complete, client)
        wait_until(lambda: stats(client)["waiting"] == 1)
        d.start()
        resp = waiting.result()
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == reply_text(
            PROMPT)


def test_a_queue_timeout_names_the_instances_down(
        store: tuple[Path, StoreManifest], fakes: Callable[..., Fake]) -> None:
    p, d = fakes(), fakes()
    with routed(store, [p], [d], queue_timeout_s=0.3) as client:
        d.kill()
        wait_until(lambda: client.get("/health").status_code == 503)
        resp = complete(client)
        assert resp.status_code == 503
        assert d.url in resp.json()["error"]["message"]


@pytest.mark.parametrize("where", ["prefill", "decode", "decode-stream"])
def test_an_instance_killed_before_the_first_token_is_retried_elsewhere(
        store: tuple[Path, StoreManifest], fakes: Callable[..., Fake], where: str) -> None:
    is_stream = where == "decode-stream"
    held = fakes("prefill" if where == "prefill" else "decode")
    other = fakes()
    if where == "prefill":
        prefill, decode = [held, other], [fakes()]
    else:
        prefill, decode = [fakes()], [held, other]
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "stream": is_stream}

    def send() -> tuple[int, str, str | None]:
        with client.stream("POST", "/v1/completions", json=body,
                           headers={"X-Request-Id": "trace-7"}) as resp:
            raw = resp.read().decode()
        if is_stream:
            words = [json.loads(x[6:])["choices"][0]["delta"]["content"]
                     for x in raw.split("\n\n") if x.startswith("data: {")]
            return resp.status_code, "".join(words), resp.headers.get("x-request-id")
        return resp.status_code, json.loads(raw)["choices"][0]["text"], \
            resp.headers.get("x-request-id")

    # Both first choices (prefill 0, decode 0: the lower ids of an idle cluster) are `held`.
    with routed(store, prefill, decode) as client, ThreadPoolExecutor(1) as pool:
        sent = pool.submit(send)
        wait_until(held.is_holding)
        held.kill()
        status, text, trace = sent.result()
        assert (status, text, trace) == (200, reply_text(PROMPT), "trace-7")
        s = stats(client)
        assert s["retries"] == 1 and s["finished"] == 1 and s["aborted"] == 0
        assert not s["prefill" if where == "prefill" else "decode"][0]["up"]
    # The second placement is a new transfer on the instances alive; the decode instance
    # that answered got the second prefill's params, never the first's.
    pre = [RouteParams.from_params(b["kv_transfer_params"])
           for f in prefill for b in f.bodies("/v1/completions")]
    assert len(pre) == 2 and all(x is not None for x in pre)
    first, second = pre
    assert first is not None and second is not None
    assert first.xfer != second.xfer
    if where != "prefill":
        assert (first.de, second.de) == (side(0), side(1))
    (got,) = (decode[0] if where == "prefill" else other).bodies("/v1/completions")
    assert got["kv_transfer_params"]["dualpath"]["xfer"] == second.xfer
    traces = {r["trace"] for f in (*prefill, *decode) for r in f.records() if "path" in r
              and r["path"] != "/tokenize"}
    assert traces == {"trace-7"}


def test_a_stream_broken_after_its_first_event_ends_with_an_error_event(
        store: tuple[Path, StoreManifest], fakes: Callable[..., Fake]) -> None:
    p, d = fakes(), fakes("stream")
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "stream": True}
    with routed(store, [p], [d]) as client, \
            client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = next(x for x in lines if x)
        assert json.loads(first[6:])["choices"][0]["delta"]["content"] == \
            stream_words(PROMPT)[0]
        wait_until(d.is_holding)
        d.kill()
        rest = [x for x in lines if x]
        assert len(rest) == 2 and rest[1] == "data: [DONE]"
        error = json.loads(rest[0][6:])["error"]
        assert error["type"] == "server_error" and d.url in error["message"]
        s = stats(client)
        assert s["stream_errors"] == 1 and s["retries"] == 0 and s["aborted"] == 1


def test_the_trace_id_reaches_both_instances(
        store: tuple[Path, StoreManifest], fakes: Callable[..., Fake]) -> None:
    p, d = fakes(), fakes()
    with routed(store, [p], [d]) as client:
        resp = complete(client)
        assert resp.status_code == 200
        trace = resp.headers["x-request-id"]
        assert len(trace) == 32
        assert complete(client, **{"X-Request-Id": "mine"}).headers["x-request-id"] == "mine"
    got = [(r["path"], r["trace"]) for f in (p, d) for r in f.records()
           if r.get("path", "").startswith("/v1/")]
    assert sorted(got) == sorted([("/v1/completions", trace)] * 2
                                 + [("/v1/completions", "mine")] * 2)
