"""What `DualPathConnector` declares to vLLM, checked through vLLM's own config logic (CPU; the
GPU paths these settings steer are `benchmarks/vllm/gpu_check/gpu_check.sh`'s). Needs vllm:
runs in `.venv-vllm` (`make vllm-test`), skipped in `.venv`."""

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


def test_vllm_gives_the_connector_lbhnc_where_flash_attention_would_get_lbnhc(
        tmp_path: Path) -> None:
    """CUDA FlashAttention declares no KV cache layout; vLLM's default for it is LBNHC (a
    page token-major), which raw page transfers cannot use. The connector's declaration wins."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )

    supported = [[x.name for x in get_supported_kv_cache_layouts([FlashAttentionBackend])]]
    assert resolve_kv_cache_layout(VllmConfig(), supported).name == "LBNHC"
    with_connector = VllmConfig(kv_transfer_config=transfer_config(tmp_path))
    assert resolve_kv_cache_layout(with_connector, supported).name == "LBHNC"


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_vllms_own_kv_views_of_a_70b_rank_give_raw_pages(tp: int) -> None:
    """vLLM's allocation (`create_kv_cache_views`) of a 70B rank's KV (64 layers, 8 KV heads /
    TP, head 128, bf16, 16-token blocks): in LBHNC (and block-outermost BLHNC) every page is
    one dense run at `address + block * block_stride_bytes`; LBNHC is refused unless a page
    has one head."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from dualpath.integrations.vllm.connector.pages import LayoutError, paged_kv_bases

    spec = FullAttentionSpec(block_size=16, num_kv_heads=8 // tp, head_size=128,
                             dtype=torch.bfloat16)
    num_layers, num_blocks = 64, 3
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    for layout in (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC, KVCacheLayout.LBNHC):
        layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, num_layers,
                                                                layout)
        raw = torch.zeros(num_layers * num_blocks * spec.page_size_bytes, dtype=torch.int8)
        views = dict(zip(names, create_kv_cache_views(
            raw, spec, num_blocks, layout,
            KVCacheTensor(size=raw.numel(), layers=names, layer_stride=layer_stride,
                          block_stride=block_stride, offset=0)), strict=True))
        if layout == KVCacheLayout.LBNHC and tp < 8:
            with pytest.raises(LayoutError, match="LBHNC"):
                paged_kv_bases(views, names, spec.page_size_bytes)
            continue
        for name, at in zip(names, paged_kv_bases(views, names, spec.page_size_bytes),
                            strict=True):
            for block in range(num_blocks):
                page = views[name][block]
                assert page.is_contiguous()
                assert at.address + block * at.block_stride_bytes == page.data_ptr()


def test_blocks_per_file_defaults_to_128_token_files_and_names_a_bad_value() -> None:
    """`kv_connector_extra_config.blocks_per_file`: vLLM's 16-token blocks get 8 a file by
    default, 128-token ones 1 (keys as before: g is in the namespace only when > 1)."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from dualpath.core.errors import SpecError
    from dualpath.integrations.vllm.connector.layout import layout_of

    def layout(block_size: int, g: object) -> tuple[int, bytes]:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=8,
                                 dtype=torch.float32)
        kv = SimpleNamespace(kv_cache_groups=[SimpleNamespace(
            kv_cache_spec=spec, layer_names=["a", "b"])], kv_cache_layout="LBHNC")
        config = SimpleNamespace(model_config=SimpleNamespace(model="m", dtype="float32"))
        out = layout_of(config, kv, g)  # type: ignore[arg-type]
        return out.blocks_per_file, out.namespace

    assert layout(16, None)[0] == 8 and layout(128, None)[0] == 1
    assert layout(16, 4)[0] == 4 and layout(16, "2")[0] == 2
    assert layout(128, None)[1] == layout(128, 1)[1]
    assert layout(16, 1)[1] != layout(16, None)[1] != layout(16, 4)[1]
    for bad in (0, -1, "x", 1.5):
        with pytest.raises(SpecError, match=r"vllm connector\.blocks_per_file"):
            layout(16, bad)
