"""What `DualPathConnector` declares to vLLM, checked through vLLM's own config logic (CPU; the
GPU paths these settings steer are `benchmarks/gpu_check.sh`'s). Needs vllm: runs in
`.venv-vllm` (`make vllm-test`), skipped in `.venv`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

pytest.importorskip("vllm")

from vllm.config import CompilationConfig, KVTransferConfig, VllmConfig
from vllm.config.compilation import CompilationMode, CUDAGraphMode
from vllm.platforms import current_platform

from dualpath.integrations.vllm.connector.dualpath_connector import (
    DualPathConnector,
)

MODULE = "dualpath.integrations.vllm.connector.dualpath_connector"


def transfer_config(store: Path) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="DualPathConnector", kv_role="kv_both",
                            kv_connector_module_path=MODULE,
                            kv_connector_extra_config={"store_path": str(store)})


@pytest.fixture
def gpu_platform() -> Iterator[None]:
    """vLLM's config logic as on a CUDA platform: CUDA graphs possible, and no CPU-platform
    hook that turns them off afterwards (vLLM's platform class, not our code)."""
    platform = type(current_platform)
    with mock.patch.object(platform, "support_static_graph_mode", return_value=True), \
            mock.patch.object(platform, "check_and_update_config"):
        yield


def test_the_connector_asks_for_piecewise_cuda_graphs() -> None:
    assert DualPathConnector.requires_piecewise_for_cudagraph({}) is True
    assert DualPathConnector.requires_piecewise_for_cudagraph({"store_path": "/x"}) is True


@pytest.mark.usefixtures("gpu_platform")
def test_vllm_turns_full_cuda_graphs_into_piecewise_for_the_connector(tmp_path: Path) -> None:
    """vLLM's default FULL_AND_PIECEWISE would replay all-decode batches as one graph,
    skipping `wait_for_layer_load` / `save_kv_layer`; with the connector it is PIECEWISE."""
    def mode(kv: KVTransferConfig | None) -> CUDAGraphMode:
        config = VllmConfig(compilation_config=CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE,
            cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE), kv_transfer_config=kv)
        return config.compilation_config.cudagraph_mode

    assert mode(None) == CUDAGraphMode.FULL_AND_PIECEWISE  # what it would be without us
    assert mode(transfer_config(tmp_path)) == CUDAGraphMode.PIECEWISE
