"""A PD-disaggregated cluster: P prefill nodes, D decode nodes, one node type, one model, and
the engines its nodes run (one per GPU, or one per `tensor_parallel_size` GPUs)."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.core.hardware import HardwareSpec
from dualpath.core.model import ModelSpec
from dualpath.core.validate import positive_int


@dataclass(frozen=True)
class ClusterSpec:
    """Frozen, validated on construction. Node `n` holds engines `n*e .. n*e+e-1`, where `e` is
    `engines_per_node`; prefill nodes come first."""

    hardware: HardwareSpec
    """The node as the preset describes it (per-GPU figures)."""
    model: ModelSpec
    num_prefill_nodes: int
    num_decode_nodes: int
    tensor_parallel_size: int = 1
    """GPUs one engine spans, on both sides (vLLM `--tensor-parallel-size`)."""

    def __post_init__(self) -> None:
        positive_int("cluster", "num_prefill_nodes", self.num_prefill_nodes)
        positive_int("cluster", "num_decode_nodes", self.num_decode_nodes)
        positive_int("cluster", "tensor_parallel_size", self.tensor_parallel_size)
        self.hardware.engine_view(self.tensor_parallel_size)  # validates the node's side
        self.model.check_tensor_parallel(self.tensor_parallel_size)

    @property
    def engine_hardware(self) -> HardwareSpec:
        """The node as its engines see it (`HardwareSpec.engine_view`): what the cost model,
        the simulator and the bottleneck-free analysis charge. `hardware` itself at TP 1."""
        return self.hardware.engine_view(self.tensor_parallel_size)

    @property
    def engines_per_node(self) -> int:
        return self.hardware.gpus_per_node // self.tensor_parallel_size

    @property
    def pd_ratio(self) -> float:
        """P/D in nodes."""
        return self.num_prefill_nodes / self.num_decode_nodes

    @property
    def num_nodes(self) -> int:
        return self.num_prefill_nodes + self.num_decode_nodes

    @property
    def num_prefill_engines(self) -> int:
        return self.num_prefill_nodes * self.engines_per_node

    @property
    def num_decode_engines(self) -> int:
        return self.num_decode_nodes * self.engines_per_node

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.hardware.gpus_per_node

    @property
    def label(self) -> str:
        """Paper-style name, e.g. `2P4D`, with the engines' size when they span GPUs
        (`1P2D TP8`)."""
        pd = f"{self.num_prefill_nodes}P{self.num_decode_nodes}D"
        return pd if self.tensor_parallel_size == 1 else f"{pd} TP{self.tensor_parallel_size}"
