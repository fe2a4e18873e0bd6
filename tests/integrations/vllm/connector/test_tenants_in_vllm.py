"""Tenants and adapters inside real vLLM (CPU, SmolLM2, vLLM's prefix cache on): runs
`tenant_probe.py`. A prompt stored under one cache salt or LoRA adapter loads nothing for
another; under its own it loads from the store (vLLM's cache emptied first), with the same
tokens. Two to eight minutes on 2 cores (CPU LoRA); skipped outside the vLLM venv."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is installed only in .venv-vllm (make vllm-setup)")

PROBE = Path(__file__).with_name("tenant_probe.py")


def test_salts_and_adapters_never_share_stored_kv() -> None:
    proc = subprocess.run([sys.executable, str(PROBE)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("TENANT_PROBE ")]
    out = json.loads(line.removeprefix("TENANT_PROBE "))
    cached = {label: r["cached"] for label, r in out.items() if isinstance(r, dict)}
    assert cached["salt a"] == 0 and cached["salt b"] == 0, cached
    assert cached["no salt"] == 0, cached
    assert cached["salt a again"] >= 256, cached
    assert out["salt a again"]["tokens"] == out["salt a"]["tokens"]
    assert cached["adapter x"] == 0 and cached["adapter y"] == 0, cached
    assert cached["adapter x again"] >= 256, cached
    assert out["adapter x again"]["tokens"] == out["adapter x"]["tokens"]
    assert out["adapter y"]["tokens"] != out["adapter x"]["tokens"]  # the adapters differ
    assert out["store_modes"] == ["0o600"]
