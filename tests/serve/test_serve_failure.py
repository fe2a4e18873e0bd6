"""A cluster failure while serving: the request in flight fails, later ones get 503, and
/health says the server is unavailable (tiny model, node threads)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dualpath.runtime.cluster import RunConfig
from dualpath.runtime.node import ModelSource, model_tokenizer
from dualpath.serve import GenerateRequest, ServeError, ServingEngine, make_server

MiB = 2**20


def get(url: str, body: object = None) -> tuple[int, dict[str, object]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_failed_node_fails_the_request_and_the_server_reports_it(tmp_path: Path) -> None:
    cfg = RunConfig(
        mode="dualpath", store_root=str(tmp_path), launch="thread", num_prefill_nodes=1,
        num_decode_nodes=1, engines_per_node=1, buffer_bytes=4 * 16 * 1024, hbm_bytes=32 * MiB,
        transfer_kind="shm", block_size=16,
    )
    with ServingEngine(cfg, model_tokenizer(ModelSource("tiny")), "tiny", 60) as engine:
        srv = make_server(engine, "127.0.0.1", 0, is_logging=False)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        host, port = srv.server_address[:2]
        base = f"http://{host!s}:{port}"
        assert get(f"{base}/health") == (200, {"status": "ok"})
        # The API refuses a prompt no node buffer holds (4 slots of 16 tokens)...
        status, err = get(f"{base}/v1/completions", {"prompt": list(range(1, 100))})
        assert status == 400 and err["error"]["param"] == "prompt"  # type: ignore[index]
        # ...submitted past it, the prefill node's reader fails and takes the cluster down.
        gen = engine.generate(GenerateRequest(tuple(range(1, 100)), 4))
        with pytest.raises(ServeError, match="BufferFullError"):
            gen.result()
        assert get(f"{base}/health")[0] == 503
        status, err = get(f"{base}/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
        assert status == 503 and "failed" in str(err["error"])
        srv.shutdown()
        srv.server_close()
