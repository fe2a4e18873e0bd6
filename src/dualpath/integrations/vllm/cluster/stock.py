"""The stock vLLM baseline: what a vLLM user deploys for P/D with KV kept in a shared folder,
without DualPath (`benchmarks/vllm/vllm_pd_bench.py --modes ...,vllm-stock`).

Every instance runs vLLM 0.32's own connectors only, through its `MultiConnector`:
1. `NixlConnector` (P/D: the prefill instance computes the prompt, the decode instance pulls
   its KV over NIXL), first, so that a decode instance's remote prefill wins the match;
2. `OffloadingConnector` with `TieringOffloadingSpec`: a CPU (DRAM) primary tier of
   `cpu_bytes` and vLLM's filesystem secondary tier (`FileSystemTierManager`, files under
   `root_dir`, the folder every instance shares). A prefill instance finds a stored prefix
   there, promotes it into its CPU tier and loads it, and computes the rest.

vLLM 0.32 on CPU refuses the second (`FS_ON_CPU_ERROR`, raised by `CPUOffloadingSpec.get_worker`
in `vllm/v1/kv_offload/cpu/spec.py` when an instance registers its KV caches: the CPU tier's
worker is for CUDA-alike and XPU devices only; the filesystem tier itself is not reached).
The closest stock configuration that runs on CPU is `fs_tier=False`: `NixlConnector` alone,
every prompt recomputed by the prefill instance (no prefix cache in device memory either, as
in the DualPath modes: the agentic working set is assumed not to fit there).

The emulated storage NIC: with `storage_read_gbps`, the filesystem tier is
`connector.paced_fs_tier.PacedFileSystemTier`, vLLM's `FileSystemTierManager` whose load jobs
each wait for the bytes they read on one token bucket per instance (the pacer the DualPath
connector's reads use); its I/O is vLLM's. Writes are not paced (nor are the DualPath
connector's). Without a rate it is vLLM's `fs` tier itself.

Nothing here imports vllm; `kv_transfer_config` is checked against vLLM's config classes in
`tests/integrations/vllm/cluster/test_stock.py` (vLLM venv).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dualpath.core.errors import SpecError

PACED_TIER_MODULE = "dualpath.integrations.vllm.connector.paced_fs_tier"
PACED_TIER_CLASS = "PacedFileSystemTier"
DEFAULT_CPU_BYTES = 512 * 2**20
"""The CPU primary tier (vLLM requires one): room for the promoted blocks of a few agents."""
FS_ON_CPU_ERROR = ("Exception: CPU Offloading is currently only supported on CUDA-alike and "
                   "XPU GPUs")
"""What a vLLM 0.32 CPU instance with the filesystem tier dies of at start-up (its log)."""


def describe(storage_read_gbps: float | None, fs_tier: bool = True,
             cpu_bytes: int = DEFAULT_CPU_BYTES) -> str:
    """The configuration's exact name, for a report."""
    if not fs_tier:
        return ("vLLM 0.32 NixlConnector P/D (kv_producer / kv_consumer, kv_buffer_device "
                "cpu), no KV tier: every prompt recomputed (the filesystem tier fails on CPU: "
                f"{FS_ON_CPU_ERROR})")
    tier = (f"{PACED_TIER_CLASS} (vLLM's FileSystemTierManager, each load job paced to "
            f"{storage_read_gbps:g} Gb/s per instance)" if storage_read_gbps
            else "fs (FileSystemTierManager, unpaced)")
    return ("vLLM 0.32 MultiConnector[NixlConnector, OffloadingConnector("
            f"TieringOffloadingSpec: CPU tier {cpu_bytes / 2**20:.0f} MiB LRU + {tier})]")


def fs_tier_config(root_dir: Path, storage_read_gbps: float | None) -> dict[str, Any]:
    """The filesystem secondary tier's entry in `secondary_tiers`."""
    if storage_read_gbps is None:
        return {"type": "fs", "root_dir": str(root_dir)}
    if not storage_read_gbps > 0:
        raise SpecError("vllm-stock", "storage_read_gbps", storage_read_gbps, "must be > 0")
    return {"type": PACED_TIER_CLASS, "module_path": PACED_TIER_MODULE,
            "root_dir": str(root_dir), "storage_read_gbps": storage_read_gbps}


def kv_transfer_config(role: str, root_dir: Path, storage_read_gbps: float | None,
                       fs_tier: bool = True, cpu_bytes: int = DEFAULT_CPU_BYTES
                       ) -> dict[str, Any]:
    """`--kv-transfer-config` of a stock instance of `role` ("prefill" or "decode"); without
    `fs_tier`, NixlConnector alone."""
    if role not in ("prefill", "decode"):
        raise SpecError("vllm-stock", "role", role, "must be prefill or decode")
    if cpu_bytes <= 0:
        raise SpecError("vllm-stock", "cpu_bytes", cpu_bytes, "must be > 0")
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    nixl = {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu"}
    if not fs_tier:
        return nixl
    offload = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes,
               "secondary_tiers": [fs_tier_config(root_dir, storage_read_gbps)]}
    return {"kv_connector": "MultiConnector", "kv_role": kv_role,
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"connectors": [
                nixl,
                {"kv_connector": "OffloadingConnector", "kv_role": kv_role,
                 "kv_connector_extra_config": offload},
            ]}}


def instance_env(host: str, nixl_port: int) -> dict[str, str]:
    """A stock instance's environment: NixlConnector's handshake listener on a port of its own
    (vLLM's default, 5600, would clash between instances on one host), and vLLM's dev
    endpoints, for `/reset_prefix_cache?reset_external=true` (the benchmark empties the CPU
    tier after turn 1, so that turn 2 reads the stored prefix from the folder)."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(nixl_port),
            "VLLM_SERVER_DEV_MODE": "1"}
