"""DualPath's P/D flow in real vLLM: a prefill and a decode server, both read paths over NIXL.

Runs `examples/vllm_pd_demo.py --failover` (two vLLM CPU servers with SmolLM2, a few
minutes) and requires every check: identical greedy tokens for full recompute, the PE path,
the DE path and a split read; the cached-token counts; the NIXL pulls in the prefill server's
event log; a corrupted block recomputed and rewritten; and issue 28's kill test on the same
cluster (the decode, then the prefill server SIGKILLed under load behind the router and
restarted: every request not yet streaming gets the tokens of a run without the kill, the
server is back in service, nothing of the killed one is left). Skipped where vllm is not
importable (it lives in `.venv-vllm`; `make test` runs this directory there too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is installed only in .venv-vllm (make vllm-setup)")

DEMO = Path(__file__).resolve().parents[3] / "examples" / "vllm_pd_demo.py"


def test_pd_read_paths_give_identical_tokens() -> None:
    from dualpath.integrations.vllm.cluster import netns

    hosts = "netns" if netns.available() is None else "loopback"
    proc = subprocess.run([sys.executable, str(DEMO), "--hosts", hosts, "--failover"],
                          capture_output=True,
                          text=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdout.strip(), proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    assert summary["hosts"] == hosts
    failed = [name for name, ok in summary["checks"].items() if not ok]
    assert not failed, (failed, json.dumps(summary, indent=1)[-4000:])
    assert proc.returncode == 0
