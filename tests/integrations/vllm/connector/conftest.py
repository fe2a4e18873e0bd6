"""Where the connector tests put vLLM's paged KV: the host by default, a GPU with
`DUALPATH_TEST_DEVICE=cuda` (benchmarks/vllm/gpu_check/gpu_check.py's `unit` step runs these
tests so on a GPU node: the CUDA copies, events, pinned staging and NIXL's VRAM registration
the CPU never takes). CI has no GPU and runs them on the host."""

from __future__ import annotations

import os

import pytest
import torch

KV_DEVICE = torch.device(os.environ.get("DUALPATH_TEST_DEVICE", "cpu"))


def pytest_configure(config: pytest.Config) -> None:
    if KV_DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("DUALPATH_TEST_DEVICE=cuda, but torch sees no CUDA GPU")
