"""`benchmarks/gpu_check.sh` is known to start before a GPU is lent: its dry run (CPU) checks the
arguments, the model and that every step's script parses; without a GPU a real run stops at
once, saying why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_check.sh"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), "--python", sys.executable, *args],
                          capture_output=True, text=True, timeout=300)


def test_the_dry_run_checks_every_step() -> None:
    proc = run("--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [line.split(":")[1].strip() for line in proc.stdout.splitlines()
             if line.startswith("dry run: ") and "ok (" not in line]
    assert steps == ["unit", "bench", "pe", "pd_tp1", "pd_tp2"]
    assert "--cuda-graphs" in proc.stdout and "--device cuda" in proc.stdout


def test_bad_arguments_are_refused_by_name() -> None:
    proc = run("--dry-run", "--steps", "bench,gpu")
    assert proc.returncode == 2 and "--steps: gpu" in proc.stderr
    proc = run("--dry-run", "--model", "/nonexistent")
    assert proc.returncode != 0 and "no config.json" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_a_real_run_fails_at_once_saying_so() -> None:
    proc = run("--steps", "bench")
    assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr
