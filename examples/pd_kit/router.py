"""A `dualpath route` process over a running `VllmCluster`, and its `/stats`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dualpath.integrations.vllm.cluster.launch import VllmCluster

REPO = Path(__file__).resolve().parents[2]
ROUTER_PYTHON = str(REPO / ".venv" / "bin" / "python") \
    if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
"""`dualpath route` runs in the main venv (`make setup`; the vLLM venv lacks dualpath's own
dependencies such as matplotlib); the vLLM servers run in this one."""


@contextmanager
def router(cluster: VllmCluster, store: Path, *flags: str) -> Iterator[str]:
    """A `dualpath route` process over the cluster; yields its base URL."""
    from dualpath.integrations.vllm.cluster.ports import free_port

    port = free_port()
    cmd = [ROUTER_PYTHON, "-m", "dualpath.cli.main", "route", "--store", str(store),
           "--port", str(port), "--poll-interval", "2", *flags]
    for inst in cluster.prefill:
        cmd += ["--prefill", inst.url]
    for inst in cluster.decode:
        cmd += ["--decode", inst.url, "--side", str(inst.side_channel)]
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"dualpath route exited with {proc.returncode}") from None
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/stats", timeout=10) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


