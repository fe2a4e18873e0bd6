"""A PD-disaggregated cluster: P prefill nodes, D decode nodes, one node type, one model."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.core.hardware import HardwareSpec
from dualpath.core.model import ModelSpec
from dualpath.core.validate import positive_int


@dataclass(frozen=True)
class ClusterSpec:
    """Frozen, validated on construction. Engines are GPUs: node n holds engines
    `n*g .. n*g+g-1`; prefill nodes come first."""

    hardware: HardwareSpec
    model: ModelSpec
    num_prefill_nodes: int
    num_decode_nodes: int

    def __post_init__(self) -> None:
        positive_int("cluster", "num_prefill_nodes", self.num_prefill_nodes)
        positive_int("cluster", "num_decode_nodes", self.num_decode_nodes)

    @property
    def pd_ratio(self) -> float:
        """P/D in nodes."""
        return self.num_prefill_nodes / self.num_decode_nodes

    @property
    def num_nodes(self) -> int:
        return self.num_prefill_nodes + self.num_decode_nodes

    @property
    def num_prefill_engines(self) -> int:
        return self.num_prefill_nodes * self.hardware.gpus_per_node

    @property
    def num_decode_engines(self) -> int:
        return self.num_decode_nodes * self.hardware.gpus_per_node

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.hardware.gpus_per_node

    @property
    def label(self) -> str:
        """Paper-style name, e.g. `2P4D`."""
        return f"{self.num_prefill_nodes}P{self.num_decode_nodes}D"
