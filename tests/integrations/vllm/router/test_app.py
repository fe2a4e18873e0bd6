"""`dualpath route` over HTTP: the router and small fake vLLM instances (FastAPI on loopback
ports) that record what they receive, with a real BlockStore holding real blocks."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dualpath.core.blocks import block_keys
from dualpath.http.server import HttpServer, ServerConfig, bind
from dualpath.integrations.vllm.manifest import RouteParams, StoreManifest
from dualpath.integrations.vllm.router.app import make_app
from dualpath.integrations.vllm.router.config import RouterConfig
from dualpath.integrations.vllm.router.policy import InstanceMetrics, route_params
from dualpath.integrations.vllm.router.router import Router
from dualpath.integrations.vllm.router.scrape import parse_vllm_metrics
from dualpath.store import BlockStore

BS = 4
BLOCK_BYTES = 64
SIDE = "127.0.0.1:5600"
PROMPT = "abcdefghijklmnopq"  # 17 tokens (one per character): 4 full blocks may hit
STORED = 3
WAIT_S = 10.0


def tokens_of(text: str) -> list[int]:
    return [ord(c) for c in text]


class FakeVllm:
    """A vLLM instance's endpoints the router uses; `gate` holds prefill replies while clear."""

    def __init__(self, is_returning_params: bool = True) -> None:
        self.received: list[tuple[str, dict[str, Any]]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.is_returning_params = is_returning_params
        self.metrics_text = ""
        app = FastAPI()

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Response:
            body = await request.json()
            self.received.append(("/tokenize", body))
            text = body["prompt"] if "prompt" in body else "".join(
                m["content"] for m in body["messages"])
            ids = tokens_of(text)
            return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": 4096})

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self.generate("/v1/completions", await request.json())

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self.generate("/v1/chat/completions", await request.json())

        @app.get("/v1/models")
        async def models() -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics_text, media_type="text/plain")

        @app.get("/health")
        async def health() -> Response:
            return JSONResponse({})

        self.app = app

    async def generate(self, path: str, body: dict[str, Any]) -> Response:
        self.received.append((path, body))
        params = RouteParams.from_params(body.get("kv_transfer_params"))
        if params is not None and body.get("max_tokens") == 1:  # the prefill step
            while not self.gate.is_set():
                await _sleep(0.005)
            reply: dict[str, Any] = {"id": "p", "choices": [{"text": "x"}]}
            if self.is_returning_params:
                done = RouteParams(params.xfer, params.de, params.hit_blocks, params.pe_blocks,
                                   tokens=17)
                reply["kv_transfer_params"] = done.to_params()
            return JSONResponse(reply)
        if body.get("stream"):
            return StreamingResponse(iter(sse_chunks()), media_type="text/event-stream")
        return JSONResponse({"id": "d", "choices": [{"text": "decoded"}], "seen": body})

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [b for p, b in self.received if p == path]


def sse_chunks() -> list[bytes]:
    return [f"data: {json.dumps({'choices': [{'delta': {'content': w}}]})}\n\n".encode()
            for w in ("Hello", " world")] + [b"data: [DONE]\n\n"]


async def _sleep(s: float) -> None:
    import asyncio
    await asyncio.sleep(s)


ROUTER = ServerConfig(log_level="warning")
"""The router's server, as `dualpath route` sets it up."""
INSTANCE = ServerConfig(log_level="warning", max_body_bytes=2**40)
"""A fake instance's: no body limit, as vLLM's server has none."""


@contextmanager
def served(app: FastAPI, config: ServerConfig) -> Iterator[str]:
    """`app` on a free loopback port in a thread; yields its base URL."""
    server = HttpServer(app, "127.0.0.1", 0, config)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    wait_until(lambda: server.is_started)
    try:
        yield server.url
    finally:
        server.stop()
        thread.join(WAIT_S)
        server.server_close()


def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)


@pytest.fixture()
def store(tmp_path: Path) -> tuple[Path, StoreManifest]:
    manifest = StoreManifest(namespace="ab" * 16, model="m", block_size=BS,
                             full_block_bytes=BLOCK_BYTES)
    manifest.write(tmp_path)
    blocks = BlockStore(tmp_path, BLOCK_BYTES, is_durable=False)
    for key in block_keys(tokens_of(PROMPT), BS, manifest.namespace_bytes)[:STORED]:
        blocks.put(key, bytes(BLOCK_BYTES))
    return tmp_path, manifest


@contextmanager
def cluster(store: tuple[Path, StoreManifest], mode: str = "dualpath",
            decode_url: str | None = None, prefill: FakeVllm | None = None,
            server: ServerConfig | None = None,
            **cfg: Any) -> Iterator[tuple[httpx2.Client, FakeVllm, FakeVllm]]:
    """A router over one fake prefill and one fake decode instance (`server`: how the
    router's HTTP server is set up); yields a client."""
    root, manifest = store
    prefill = prefill or FakeVllm()
    decode = FakeVllm()
    beta = cfg.pop("beta_tokens", 1e9)
    params, _ = route_params(mode, BS, BLOCK_BYTES / BS, alpha_tokens=1e9, beta_tokens=beta)
    with served(prefill.app, INSTANCE) as p_url, served(decode.app, INSTANCE) as d_url:
        config = RouterConfig(prefill=(p_url,), decode=(decode_url or d_url,), sides=(SIDE,),
                              store=root, manifest=manifest, params=params, mode=mode,
                              poll_interval_s=0.02, **cfg)
        with served(make_app(Router(config)), server or ROUTER) as url, \
                httpx2.Client(base_url=url, timeout=WAIT_S) as client:
            yield client, prefill, decode


def idle(client: httpx2.Client) -> bool:
    s = client.get("/stats").json()
    return s["waiting"] == 0 and all(
        i["in_flight"] == 0 and i["read_queue_tokens"] == 0 for i in s["prefill"] + s["decode"])


def test_bodies_to_prefill_and_decode(store: tuple[Path, StoreManifest]) -> None:
    with cluster(store) as (client, prefill, decode):
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 7, "temperature": 0.0,
                "kv_transfer_params": {"client": "ignored"}}
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        (sent,) = prefill.bodies("/v1/completions")
        assert sent["max_tokens"] == 1 and sent["stream"] is False and sent["n"] == 1
        assert sent["temperature"] == 0.0 and sent["prompt"] == PROMPT
        params = RouteParams.from_params(sent["kv_transfer_params"])
        assert params is not None
        assert (params.hit_blocks, params.pe_blocks, params.de) == (STORED, STORED, SIDE)
        assert len(params.xfer) == 32
        assert RouteParams.from_params(params.to_params()) == params
        assert prefill.bodies("/tokenize") == [{"model": "m", "prompt": PROMPT}]
        (got,) = decode.bodies("/v1/completions")
        back = {**body, "kv_transfer_params": {"dualpath": {**sent["kv_transfer_params"][
            "dualpath"], "tokens": 17}}}
        assert got == back
        assert resp.json()["seen"] == back  # the decode instance's reply, unchanged
        assert idle(client)
        stats = client.get("/stats").json()
        assert stats["requests_by_path"]["pe"] == 1
        assert stats["hit_blocks_by_side"] == {"pe": STORED, "de": 0}
        assert stats["hit_bytes_by_side"]["pe"] == STORED * BLOCK_BYTES
        assert stats["finished"] == 1


def test_chat_streams_through(store: tuple[Path, StoreManifest]) -> None:
    with cluster(store) as (client, prefill, decode):
        body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}],
                "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 2,
                "max_completion_tokens": 9}
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            raw = b"".join(resp.iter_raw())
        assert raw == b"".join(sse_chunks())
        (sent,) = prefill.bodies("/v1/chat/completions")
        assert sent["max_tokens"] == 1 and sent["max_completion_tokens"] == 1
        assert sent["stream"] is False
        assert "stream_options" not in sent and "min_tokens" not in sent
        (tok,) = prefill.bodies("/tokenize")
        assert tok == {"model": "m", "messages": body["messages"]}
        (got,) = decode.bodies("/v1/chat/completions")
        assert {k: v for k, v in got.items() if k != "kv_transfer_params"} == body
        assert got["kv_transfer_params"]["dualpath"]["tokens"] == 17
        wait_until(lambda: idle(client))


@pytest.mark.parametrize(("mode", "second_pe_blocks"), [("dualpath", 0), ("basic", STORED)])
def test_a_longer_pe_read_queue_sends_the_next_read_de(
        store: tuple[Path, StoreManifest], mode: str, second_pe_blocks: int) -> None:
    with cluster(store, mode) as (client, prefill, _decode), ThreadPoolExecutor(2) as pool:
        prefill.gate.clear()
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 3}
        calls: list[Future[httpx2.Response]] = []
        for n in (1, 2):
            calls.append(pool.submit(client.post, "/v1/completions", json=body))
            wait_until(lambda n=n: len(prefill.bodies("/v1/completions")) == n)
        first, second = (RouteParams.from_params(b["kv_transfer_params"])
                         for b in prefill.bodies("/v1/completions"))
        assert first is not None and second is not None
        assert first.pe_blocks == STORED
        assert second.pe_blocks == second_pe_blocks and second.hit_blocks == STORED
        stats = client.get("/stats").json()
        pe_q, de_q = stats["prefill"][0]["read_queue_tokens"], stats["decode"][0][
            "read_queue_tokens"]
        assert pe_q + de_q == 2 * STORED * BS
        assert pe_q == (2 * STORED * BS if mode == "basic" else STORED * BS)
        text = client.get("/metrics").text
        assert f'dualpath_router:read_queue_tokens{{instance="{stats["prefill"][0]["url"]}",' \
               f'model_name="m",node="0",role="prefill"}} {float(pe_q)}' in text
        prefill.gate.set()
        assert [c.result().status_code for c in calls] == [200, 200]
        assert idle(client)
        text = client.get("/metrics").text
        path = "pe" if mode == "basic" else "de"
        assert f'dualpath_router:requests_total{{model_name="m",path="{path}"}} ' \
               f'{2.0 if mode == "basic" else 1.0}' in text
        assert f'dualpath_router:hit_bytes_total{{model_name="m",side="pe"}} ' \
               f'{float((2 if mode == "basic" else 1) * STORED * BLOCK_BYTES)}' in text


def test_overloaded_prefill_waits_then_503(store: tuple[Path, StoreManifest]) -> None:
    with cluster(store, beta_tokens=1, queue_timeout_s=0.3) as (client, prefill, _), \
            ThreadPoolExecutor(2) as pool:
        prefill.gate.clear()
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 3}
        first = pool.submit(client.post, "/v1/completions", json=body)
        wait_until(lambda: len(prefill.bodies("/v1/completions")) == 1)
        second = client.post("/v1/completions", json=body)  # tok 17 > beta 1: waits, then 503
        assert second.status_code == 503
        assert second.json()["error"]["type"] == "server_error"
        third = pool.submit(client.post, "/v1/completions", json=body)
        wait_until(lambda: client.get("/stats").json()["waiting"] == 1)
        prefill.gate.set()  # the first prefill replies: the third is placed
        assert first.result().status_code == 200 and third.result().status_code == 200
        assert len(prefill.bodies("/v1/completions")) == 2
        assert idle(client)
        assert 'dualpath_router:queue_timeouts_total{model_name="m"} 1.0' in \
            client.get("/metrics").text


def test_a_dead_decode_instance_is_a_503_naming_it(store: tuple[Path, StoreManifest]) -> None:
    # Marked down (its poll or the request's connection is refused), the only decode
    # instance takes no request: each waits for it (a restart) until the queue timeout.
    dead = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{dead.getsockname()[1]}"
    dead.close()  # nothing listens there now
    with cluster(store, decode_url=url, queue_timeout_s=0.3) as (client, _prefill, _decode):
        for stream in (False, True):
            resp = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT,
                                                         "stream": stream})
            assert resp.status_code == 503
            assert url in resp.json()["error"]["message"]
        assert idle(client)
        stats = client.get("/stats").json()
        assert stats["aborted"] == 2 and not stats["decode"][0]["up"]
        assert client.get("/health").json()["status"] == "unavailable"


def test_prefill_without_kv_params_still_decodes(store: tuple[Path, StoreManifest]) -> None:
    with cluster(store, prefill=FakeVllm(is_returning_params=False)) as (client, _, decode):
        resp = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3]})
        assert resp.status_code == 200
        (got,) = decode.bodies("/v1/completions")
        assert got == {"model": "m", "prompt": [1, 2, 3]}


def test_bad_bodies_are_400(store: tuple[Path, StoreManifest]) -> None:
    with cluster(store) as (client, prefill, _):
        for body in (b"not json", b"[1]", b'{"prompt": ["a", "b"]}', b'{"prompt": ""}',
                     b'{"prompt": "a", "stream": "yes"}', b'{"prompt": "a", "max_tokens": -1}'):
            resp = client.post("/v1/completions", content=body)
            assert resp.status_code == 400, body
            assert resp.json()["error"]["type"] == "invalid_request_error"
        assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400
        assert prefill.received == []
        assert client.get("/v1/models").json()["data"][0]["id"] == "m"


def test_api_key(store: tuple[Path, StoreManifest]) -> None:
    with cluster(store, server=ServerConfig(api_key="k", log_level="warning")) as (client, _, _):
        body = {"model": "m", "prompt": PROMPT}
        assert client.post("/v1/completions", json=body).status_code == 401
        ok = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200
        assert client.get("/metrics").status_code == 200
        assert client.get("/health").status_code == 200


def test_decode_kv_memory_comes_from_the_polled_metrics(
        store: tuple[Path, StoreManifest]) -> None:
    with cluster(store) as (client, _prefill, decode):
        decode.metrics_text = (
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            "# TYPE vllm:cache_config_info gauge\n"
            'vllm:cache_config_info{block_size="4",engine="0",num_gpu_blocks="100"} 1.0\n')
        wait_until(lambda: client.get("/stats").json()["decode"][0]["metrics"] is not None
                   and client.get("/stats").json()["decode"][0]["metrics"]["running"] == 2)
        d = client.get("/stats").json()["decode"][0]
        assert d["metrics"]["kv_capacity_bytes"] == 100 * BLOCK_BYTES
        assert d["free_kv_bytes"] == 75 * BLOCK_BYTES
        assert 'dualpath_router:free_kv_bytes{' in client.get("/metrics").text


def test_metrics_parser_tolerates_absence() -> None:
    assert parse_vllm_metrics("", 16.0).kv_usage is None
    m = parse_vllm_metrics('vllm:gpu_cache_usage_perc{engine="0"} 0.5\n', 16.0)
    assert m.kv_usage == 0.5 and m.running is None and m.kv_capacity_bytes is None


def test_metrics_parser_reads_its_families_among_the_rest() -> None:
    # Only the families it reads are parsed: lookalike names, histograms, comments and CRLF
    # around them change nothing.
    page = "\r\n".join([
        "# HELP vllm:num_requests_running Requests running.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 3.0',
        "# TYPE vllm:num_requests_running_seconds histogram",
        'vllm:num_requests_running_seconds_bucket{engine="0",le="+Inf"} 99.0',
        'vllm:num_requests_running_seconds_count{engine="0"} 99.0',
        'vllm:num_requests_waiting_total{engine="0"} 50.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0',
        'vllm:kv_cache_usage_perc{engine="0"} 0.25',
        'vllm:kv_cache_usage_perc{engine="1"} 0.5',
        'vllm:cache_config_info{block_size="4",engine="0",num_gpu_blocks="10"} 1.0',
        'vllm:cache_config_info{block_size="4",engine="1",num_gpu_blocks="5"} 1.0',
    ]) + "\r\n"
    assert parse_vllm_metrics(page, 2.0) == InstanceMetrics(
        running=5, waiting=1, kv_usage=0.5, kv_capacity_bytes=(10 + 5) * 4 * 2)


def test_metrics_parser_reads_only_its_lines() -> None:
    # The rest of the page never reaches Prometheus' parser: a line of another family that
    # it refuses (a plugin's unquoted label, a bad value) cannot fail the poll and mark the
    # instance down, and a page of 200k histogram lines costs one scan, not a parse.
    junk = [f'vllm:request_latency_seconds_bucket{{engine="0",le="{i}"}} {i}.0'
            for i in range(200_000)]
    page = "\n".join([
        *junk,
        'vllm:plugin_info{engine="0",version=1.2} 1.0',
        'vllm:plugin_bytes{engine="0"} many',
        'vllm:num_requests_running{engine="0",model_name="m"} 4.0',
        'vllm:kv_cache_usage_perc{engine="0"} 0.75',
    ]) + "\n"
    assert parse_vllm_metrics(page, 2.0) == InstanceMetrics(
        running=4, waiting=None, kv_usage=0.75, kv_capacity_bytes=None)


# -- the HTTP floor's protections (dualpath.http), as `dualpath serve` has them ----------------
BIG_BYTES = 50 * 2**20


def test_a_50_mb_body_is_refused_with_413_unread(store: tuple[Path, StoreManifest]) -> None:
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * BIG_BYTES}]}
    with cluster(store) as (client, prefill, decode):
        resp = client.post("/v1/chat/completions", json=big)  # Content-Length: 50 MB
        assert resp.status_code == 413, resp.text[:200]
        assert resp.json()["error"]["type"] == "invalid_request_error"
        assert resp.headers["connection"] == "close"

        def chunks() -> Iterator[bytes]:  # no Content-Length: refused once past the limit
            yield b'{"model": "m", "prompt": "'
            for _ in range(BIG_BYTES // 2**20):
                yield b"x" * 2**20
            yield b'"}'

        resp = client.post("/v1/completions", content=chunks())
        assert resp.status_code == 413, resp.text[:200]
        assert "over" in resp.json()["error"]["message"]
        assert prefill.received == [] and decode.received == []
        assert client.post("/v1/completions", json={"model": "m", "prompt": PROMPT}
                           ).status_code == 200


def test_slow_and_idle_clients_are_cut_at_the_timeout(store: tuple[Path, StoreManifest]) -> None:
    cfg = ServerConfig(head_timeout_s=0.5, body_timeout_s=0.5, keep_alive_s=1.0,
                       log_level="warning")
    with cluster(store, server=cfg) as (client, prefill, _decode):
        port = client.base_url.port
        assert port is not None
        socks = []
        for head in (b"", b"GET /health HTTP/1.1\r\nHost: x\r\n",  # silent; a slow head
                     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"):
            s = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
            s.sendall(head)
            socks.append(s)
        for s in socks[:2]:
            assert s.recv(4096) == b""  # closed by the router, not by our timeout
        assert b"408" in socks[2].recv(4096).split(b"\r\n")[0]  # the body never came
        for s in socks:
            s.close()
        assert prefill.received == []
        # An idle kept-alive connection is closed after keep_alive_s.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
        conn.request("GET", "/health")
        conn.getresponse().read()
        assert conn.sock is not None and conn.sock.recv(1) == b""
        conn.close()


def test_the_route_command_refuses_50_mb_and_stops_on_sigint(
        store: tuple[Path, StoreManifest]) -> None:
    # `dualpath route` itself, in its own process: the body is refused before any instance
    # is asked (none listens on port 9).
    dead = "http://127.0.0.1:9"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dualpath.cli.main", "route", "--store", str(store[0]),
         "--prefill", dead, "--decode", dead, "--side", "127.0.0.1:9", "--port", "0"],
        stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = ""
        while "dualpath route: http://" not in line:
            line = proc.stderr.readline()
            assert line, "the router exited before it served"
        url = line.split("dualpath route: ", 1)[1].split("/v1", 1)[0]
        big = {"model": "m", "messages": [{"role": "user", "content": "x" * BIG_BYTES}]}
        with httpx2.Client(base_url=url, timeout=WAIT_S) as client:
            resp = client.post("/v1/chat/completions", json=big)
        assert resp.status_code == 413 and "at most" in resp.json()["error"]["message"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(WAIT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
