"""DualPathConnector inside real vLLM (CPU) with SmolLM2: runs `examples/vllm_connector_demo.py`.

Skipped where vllm is not importable (the main `.venv`; `make test`). In the vLLM venv:
`.venv-vllm/bin/python -m pytest tests/integrations/test_vllm_connector.py` (3-4 minutes on
2 cores). The demo asserts identical greedy tokens with and without the connector, turn 2's
cached tokens from storage, and a corrupted block recomputed; this test requires every check.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is installed only in .venv-vllm (make vllm-setup)")

DEMO = Path(__file__).resolve().parents[4] / "examples" / "vllm_connector_demo.py"


def test_connector_demo_passes_every_check() -> None:
    proc = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True,
                          timeout=1800)
    assert proc.stdout.strip(), proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    failed = [name for name, ok in summary["checks"].items() if not ok]
    assert not failed, json.dumps(summary, indent=1)
    assert proc.returncode == 0
    assert summary["turn2_cached_tokens"]["connector"] >= 2 * summary["block_size"]
