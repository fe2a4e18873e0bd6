"""Per-node hardware of a PD-disaggregated cluster, and named presets.

Notation follows the paper's §4.2: a node has `g` GPUs, each paired with one compute NIC (CNIC)
of bandwidth `B`; the node's storage NIC (SNIC) has bandwidth `s * B`; its DRAM has bandwidth `M`
(half duplex: reads and writes share it).

An engine (one prefill or decode instance) may span several GPUs of a node (tensor parallel).
`HardwareSpec.engine_view` gives the node as such engines see it: every per-GPU resource summed
over the engine's GPUs (its compute NICs, PCIe, HBM, FLOP/s) and `g` counting engines, so the
paper's per-GPU analysis and the cost model apply per engine unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

from dualpath.core.errors import SpecError, UnknownPresetError
from dualpath.core.units import GB, TFLOPS, GiB, MiB, gbit_per_s
from dualpath.core.validate import non_negative, positive, positive_int


@dataclass(frozen=True)
class HardwareSpec:
    """One node type. Frozen, validated on construction; units are in the field names."""

    name: str
    gpus_per_node: int
    """`g`: GPUs per node; in an `engine_view`, engines per node."""
    compute_nic_bytes_per_s: float
    """`B`: one GPU's compute-NIC bandwidth per direction."""
    storage_nic_bytes_per_s: float
    """`s * B`: the node's storage-NIC bandwidth per direction (shared by its engines)."""
    dram_bytes_per_s: float
    """`M`: the node's DRAM bandwidth, half duplex (reads + writes share it)."""
    dram_buffer_bytes: int
    """DRAM the node sets aside as PE/DE buffer."""
    hbm_bytes: int
    """HBM per GPU."""
    pcie_bytes_per_s: float
    """PCIe bandwidth per direction between one GPU/NIC pair and the host."""
    gpu_bf16_flops_per_s: float
    """Dense BF16 FLOP/s per GPU (no sparsity)."""
    gpu_fp8_flops_per_s: float
    """Dense FP8 FLOP/s per GPU (no sparsity)."""
    hbm_bytes_per_s: float
    """HBM bandwidth per GPU."""
    source: str = ""
    """Where the numbers come from."""
    nvlink_bytes_per_s: float = 0.0
    """GPU-to-GPU bandwidth inside the node, per GPU, both directions together (NVLink, as
    NVIDIA quotes it); what a tensor-parallel engine's all-reduces cross. 0: no such link, so an
    engine cannot span GPUs. Per GPU in an `engine_view` too."""
    gpus_per_engine: int = 1
    """GPUs one engine spans (its tensor-parallel size); 1 for a node as the presets describe
    it. In an `engine_view` of more, the per-GPU fields above (compute NIC, HBM, PCIe, FLOP/s,
    HBM bandwidth) are per engine, the sum over its GPUs."""

    def __post_init__(self) -> None:
        owner = f"hardware[{self.name}]"
        positive_int(owner, "gpus_per_node", self.gpus_per_node)
        for field in (
            "compute_nic_bytes_per_s",
            "storage_nic_bytes_per_s",
            "dram_bytes_per_s",
            "dram_buffer_bytes",
            "hbm_bytes",
            "pcie_bytes_per_s",
            "gpu_bf16_flops_per_s",
            "gpu_fp8_flops_per_s",
            "hbm_bytes_per_s",
        ):
            positive(owner, field, getattr(self, field))
        non_negative(owner, "nvlink_bytes_per_s", self.nvlink_bytes_per_s)
        positive_int(owner, "gpus_per_engine", self.gpus_per_engine)
        if self.storage_nic_ratio > self.gpus_per_node:
            raise SpecError(
                owner,
                "storage_nic_bytes_per_s",
                self.storage_nic_bytes_per_s,
                f"s = storage/compute-NIC ratio {self.storage_nic_ratio:g} exceeds "
                f"g = {self.gpus_per_node} (the storage NIC would outrun all compute NICs)",
            )

    @property
    def storage_nic_ratio(self) -> float:
        """`s`: storage-NIC bandwidth per node in units of one compute NIC."""
        return self.storage_nic_bytes_per_s / self.compute_nic_bytes_per_s

    @property
    def node_compute_nic_bytes_per_s(self) -> float:
        """All compute NICs of one node together, per direction."""
        return self.compute_nic_bytes_per_s * self.gpus_per_node

    def with_overrides(self, **fields: object) -> HardwareSpec:
        """A copy with some fields replaced (validated again)."""
        return replace(self, **fields)  # type: ignore[arg-type]

    def engine_view(self, tensor_parallel_size: int) -> HardwareSpec:
        """The node as engines of `tensor_parallel_size` GPUs each see it (see the module
        docstring); this spec itself for its own size. The same object for the same arguments,
        so cost constants cached by identity stay cached."""
        return _engine_view(self, tensor_parallel_size)


@cache
def _engine_view(hw: HardwareSpec, tp: int) -> HardwareSpec:
    owner = f"hardware[{hw.name}]"
    positive_int(owner, "tensor_parallel_size", tp)
    if tp == hw.gpus_per_engine:
        return hw
    if hw.gpus_per_engine != 1:
        raise SpecError(owner, "gpus_per_engine", hw.gpus_per_engine,
                        "is already an engine view; take the view of the node's spec")
    if hw.gpus_per_node % tp:
        raise SpecError(owner, "tensor_parallel_size", tp,
                        f"must divide the {hw.gpus_per_node} GPUs of a node")
    if hw.nvlink_bytes_per_s <= 0:
        raise SpecError(owner, "nvlink_bytes_per_s", hw.nvlink_bytes_per_s,
                        "an engine spanning GPUs needs a GPU-to-GPU link (> 0)")
    return replace(
        hw,
        gpus_per_node=hw.gpus_per_node // tp,
        compute_nic_bytes_per_s=hw.compute_nic_bytes_per_s * tp,
        hbm_bytes=hw.hbm_bytes * tp,
        pcie_bytes_per_s=hw.pcie_bytes_per_s * tp,
        gpu_bf16_flops_per_s=hw.gpu_bf16_flops_per_s * tp,
        gpu_fp8_flops_per_s=hw.gpu_fp8_flops_per_s * tp,
        hbm_bytes_per_s=hw.hbm_bytes_per_s * tp,
        gpus_per_engine=tp,
    )


_H800_SOURCE = (
    "paper §2.3/§7.1: 8 Hopper GPUs, 8x400 Gb/s CNIC, 1x400 Gb/s SNIC per node; M ~500 GB/s "
    "(paper §4.2); 80 GB DRAM buffer per node for DeepSeek models (A.4); H800 SXM datasheet "
    "989/1979 TFLOP/s dense bf16/fp8, 80 GB HBM3 at 3.35 TB/s, NVLink 400 GB/s; PCIe Gen5 x16 "
    "~63 GB/s"
)

HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "h800-deepseek": HardwareSpec(
        name="h800-deepseek",
        gpus_per_node=8,
        compute_nic_bytes_per_s=gbit_per_s(400),
        storage_nic_bytes_per_s=gbit_per_s(400),
        dram_bytes_per_s=500 * GB,
        dram_buffer_bytes=80 * GB,
        hbm_bytes=80 * GB,
        pcie_bytes_per_s=63 * GB,
        gpu_bf16_flops_per_s=989 * TFLOPS,
        gpu_fp8_flops_per_s=1979 * TFLOPS,
        hbm_bytes_per_s=3.35e12,
        source=_H800_SOURCE,
        nvlink_bytes_per_s=400 * GB,
    ),
    "dgx-h100": HardwareSpec(
        name="dgx-h100",
        gpus_per_node=8,
        compute_nic_bytes_per_s=gbit_per_s(400),
        storage_nic_bytes_per_s=2 * gbit_per_s(400),
        dram_bytes_per_s=500 * GB,
        dram_buffer_bytes=80 * GB,
        hbm_bytes=80 * GB,
        pcie_bytes_per_s=63 * GB,
        gpu_bf16_flops_per_s=989 * TFLOPS,
        gpu_fp8_flops_per_s=1979 * TFLOPS,
        hbm_bytes_per_s=3.35e12,
        source=(
            "NVIDIA DGX H100 user guide: 8x ConnectX-7 400 Gb/s compute, 2x400 Gb/s storage "
            "ports; H100 SXM datasheet dense 989/1979 TFLOP/s, 80 GB at 3.35 TB/s; M set to the "
            "paper's 500 GB/s (DDR5-4800 on 2x8 channels is ~614 GB/s theoretical); NVLink 4 "
            "900 GB/s per GPU"
        ),
        nvlink_bytes_per_s=900 * GB,
    ),
    "h200": HardwareSpec(
        name="h200",
        gpus_per_node=8,
        compute_nic_bytes_per_s=gbit_per_s(400),
        storage_nic_bytes_per_s=2 * gbit_per_s(400),
        dram_bytes_per_s=500 * GB,
        dram_buffer_bytes=80 * GB,
        hbm_bytes=141 * GB,
        pcie_bytes_per_s=63 * GB,
        gpu_bf16_flops_per_s=989 * TFLOPS,
        gpu_fp8_flops_per_s=1979 * TFLOPS,
        hbm_bytes_per_s=4.8e12,
        source=(
            "HGX/DGX H200 class node: 8x H200 SXM (datasheet dense 989/1979 TFLOP/s, 141 GB "
            "at 4.8 TB/s, NVLink 4 900 GB/s), 8x400 Gb/s compute NICs, 2x400 Gb/s storage as on "
            "DGX; M as the paper"
        ),
        nvlink_bytes_per_s=900 * GB,
    ),
    "b200": HardwareSpec(
        name="b200",
        gpus_per_node=8,
        compute_nic_bytes_per_s=gbit_per_s(400),
        storage_nic_bytes_per_s=2 * gbit_per_s(400),
        dram_bytes_per_s=600 * GB,
        dram_buffer_bytes=80 * GB,
        hbm_bytes=180 * GB,
        pcie_bytes_per_s=63 * GB,
        gpu_bf16_flops_per_s=2250 * TFLOPS,
        gpu_fp8_flops_per_s=4500 * TFLOPS,
        hbm_bytes_per_s=7.7e12,
        source=(
            "DGX B200 (recalled): 8x B200 (dense 2.25/4.5 PFLOP/s bf16/fp8, 180 GB at ~7.7 TB/s), "
            "8x400 Gb/s ConnectX-7 compute, 2x400 Gb/s storage via BlueField-3; M ~600 GB/s "
            "assumed (2x Xeon 8570 DDR5-5600); NVLink 5 1.8 TB/s per GPU; treat as a default to "
            "calibrate"
        ),
        nvlink_bytes_per_s=1800 * GB,
    ),
    "cpu-emulated": HardwareSpec(
        name="cpu-emulated",
        gpus_per_node=2,
        compute_nic_bytes_per_s=800 * MiB,
        storage_nic_bytes_per_s=200 * MiB,
        dram_bytes_per_s=4 * GiB,
        dram_buffer_bytes=256 * MiB,
        hbm_bytes=1 * GiB,
        pcie_bytes_per_s=2 * GiB,
        gpu_bf16_flops_per_s=0.05 * TFLOPS,
        gpu_fp8_flops_per_s=0.05 * TFLOPS,
        hbm_bytes_per_s=5 * GiB,
        source=(
            "emulated on one CPU machine for the runtime: 2 engines per node; the storage NIC "
            "(200 MiB/s) is 1/8 of the node's compute NICs (2x800 MiB/s), as 1x400 Gb/s vs "
            "8x400 Gb/s on the paper's nodes, so the bottleneck-free range is the paper's 1/7..7/2"
        ),
    ),
}


def hardware_preset(name: str) -> HardwareSpec:
    """The named preset; UnknownPresetError lists the valid names."""
    try:
        return HARDWARE_PRESETS[name]
    except KeyError:
        raise UnknownPresetError("hardware", name, list(HARDWARE_PRESETS)) from None
