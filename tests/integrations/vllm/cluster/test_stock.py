"""The stock vLLM baseline's configuration (`cluster.stock`): its shape here, and, in the vLLM
venv (`make vllm-test`), vLLM's own config classes and factories resolving it to NixlConnector,
OffloadingConnector, TieringOffloadingSpec and the filesystem tier, and the paced tier's loads
through vLLM's FileSystemTierManager I/O. No vLLM server is started."""

from __future__ import annotations

import mmap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from dualpath.core.errors import SpecError
from dualpath.integrations.vllm.cluster import stock
from dualpath.integrations.vllm.cluster.spec import VllmClusterSpec


def test_the_prefill_and_decode_configs_put_nixl_first_and_the_folder_tier_second(
        tmp_path: Path) -> None:
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        cfg = stock.kv_transfer_config(role, tmp_path, 0.5)
        nixl, offload = cfg["kv_connector_extra_config"]["connectors"]
        assert (cfg["kv_connector"], cfg["kv_role"]) == ("MultiConnector", kv_role)
        assert (nixl["kv_connector"], nixl["kv_role"]) == ("NixlConnector", kv_role)
        assert offload["kv_connector"] == "OffloadingConnector"
        [tier] = offload["kv_connector_extra_config"]["secondary_tiers"]
        assert tier == {"type": "PacedFileSystemTier", "module_path": stock.PACED_TIER_MODULE,
                        "root_dir": str(tmp_path), "storage_read_gbps": 0.5}
    unpaced = stock.kv_transfer_config("prefill", tmp_path, None)
    [tier] = unpaced["kv_connector_extra_config"]["connectors"][1][
        "kv_connector_extra_config"]["secondary_tiers"]
    assert tier == {"type": "fs", "root_dir": str(tmp_path)}
    assert stock.kv_transfer_config("decode", tmp_path, 0.5, fs_tier=False) == {
        "kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu"}


def test_bad_stock_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="role"):
        stock.kv_transfer_config("both", tmp_path, None)
    with pytest.raises(SpecError, match="storage_read_gbps"):
        stock.kv_transfer_config("prefill", tmp_path, -1.0)
    with pytest.raises(SpecError, match="stack"):
        VllmClusterSpec(model="m", store=tmp_path, python="python", stack="lmcache")


def test_the_description_names_what_ran() -> None:
    assert "PacedFileSystemTier" in stock.describe(0.1)
    assert "0.1 Gb/s" in stock.describe(0.1)
    recompute = stock.describe(0.1, fs_tier=False)
    assert "NixlConnector" in recompute and "recomputed" in recompute
    assert stock.FS_ON_CPU_ERROR in recompute


@pytest.mark.parametrize("fs_tier", [True, False])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_vllm_resolves_the_stock_config_to_its_own_connectors(
        tmp_path: Path, role: str, fs_tier: bool) -> None:
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from dualpath.integrations.vllm.connector.paced_fs_tier import PacedFileSystemTier

    transfer = KVTransferConfig(**stock.kv_transfer_config(role, tmp_path, 0.1, fs_tier))
    assert transfer.is_kv_producer == (role == "prefill")
    assert transfer.is_kv_consumer == (role == "decode")
    cls = KVConnectorFactory.get_connector_class(transfer)
    if not fs_tier:
        assert cls is NixlConnector  # (vLLM 0.32: an alias of NixlPullConnector)
        return
    assert cls is MultiConnector
    parts = MultiConnector._get_connector_classes_and_configs(
        VllmConfig(kv_transfer_config=transfer))
    assert [c for c, _ in parts] == [NixlConnector, OffloadingConnector]
    offload = parts[1][1].kv_transfer_config
    assert offload is not None
    extra = offload.kv_connector_extra_config
    assert OffloadingSpecFactory.get_spec_cls(extra) is TieringOffloadingSpec
    [tier] = extra["secondary_tiers"]
    assert SecondaryTierFactory.get_tier_class(tier) is PacedFileSystemTier
    assert issubclass(PacedFileSystemTier, FileSystemTierManager)
    plain = stock.fs_tier_config(tmp_path, None)
    assert SecondaryTierFactory.get_tier_class(plain) is FileSystemTierManager


def _offloading_spec(tmp_path: Path) -> Any:
    """What a filesystem tier reads of its OffloadingSpec (the spec itself needs a worker's
    KV caches): vLLM's OffloadingConfig, blocks_per_chunk, kv_events_config."""
    from vllm.config import KVEventsConfig
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer.0",), 0),), worker_kv_bytes_per_block=1,
        enable_kv_cache_events=False, extra_config={}, engine_id="test",
        model=OffloadingModelConfig("m", "float32"), cache=OffloadingCacheConfig(16, 1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True))
    return SimpleNamespace(config=config, blocks_per_chunk=1,
                           kv_events_config=KVEventsConfig())


def test_the_paced_tier_stores_and_loads_blocks_no_faster_than_its_rate(
        tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from dualpath.integrations.vllm.connector.paced_fs_tier import PacedFileSystemTier

    block_bytes, num_blocks, gbps = 1 << 20, 4, 0.1
    # Page-aligned, as vLLM's CPU tier (an mmap) is: the tier writes with O_DIRECT where it can.
    region = mmap.mmap(-1, 2 * num_blocks * block_bytes)
    primary = np.frombuffer(region, dtype=np.uint8).reshape(2 * num_blocks, block_bytes)
    rng = np.random.default_rng(0)
    primary[:num_blocks] = rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8)
    tier = PacedFileSystemTier(
        storage_read_gbps=gbps, offloading_spec=_offloading_spec(tmp_path),
        primary_kv_view=memoryview(primary), tier_type="PacedFileSystemTier",
        root_dir=str(tmp_path), n_read_threads=2, n_write_threads=2)
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(num_blocks)]

    def run(job_id: int, chunks: range, is_load: bool) -> float:
        job = TransferJob(job_id, keys, np.array(list(chunks)), is_load, ReqContext("r"))
        t0 = time.monotonic()
        (tier.submit_load if is_load else tier.submit_store)(job)
        tier.drain_jobs()
        [result] = list(tier.get_finished_jobs())
        assert result.success
        return time.monotonic() - t0

    try:
        run(1, range(num_blocks), False)
        load_s = run(2, range(num_blocks, 2 * num_blocks), True)
    finally:
        tier.shutdown()
    assert (primary[num_blocks:] == primary[:num_blocks]).all()
    assert tier.pacer.num_bytes == num_blocks * block_bytes
    assert load_s >= num_blocks * block_bytes / (gbps * 1e9 / 8) * 0.99
