"""The paper's evaluation setups (§7.1, digest §6.6) as named cluster builders.

A setup is a model on the paper's node type with a default P/D; experiments may change P and D
(Fig. 8, Table 3, `advise`). Qwen runs get the 320 GB DRAM buffer the paper gives it (A.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from dualpath.core.cluster import ClusterSpec
from dualpath.core.errors import UnknownPresetError
from dualpath.core.hardware import hardware_preset
from dualpath.core.model import model_preset
from dualpath.core.units import GB
from dualpath.plan.step_profile import Profile, load_profile
from dualpath.sim.workload import Workload

HARDWARE = "h800-deepseek"
"""The paper's node: 8 Hopper GPUs, 8 x 400 Gb/s compute NICs, one 400 Gb/s storage NIC."""


@dataclass(frozen=True)
class Setup:
    """A model and its default P/D in nodes, as the paper ran it."""

    name: str
    model: str
    num_prefill_nodes: int
    num_decode_nodes: int
    dram_buffer_gb: float = 80.0
    label: str = ""
    """How the paper names it in figures, e.g. `DS 660B 2P4D`."""
    hardware: str = HARDWARE

    def cluster(
        self, num_prefill_nodes: int | None = None, num_decode_nodes: int | None = None
    ) -> ClusterSpec:
        """The cluster of this setup, optionally at another P/D."""
        hw = hardware_preset(self.hardware)
        if self.dram_buffer_gb * GB != hw.dram_buffer_bytes:
            hw = hw.with_overrides(
                name=f"{hw.name}+buffer{self.dram_buffer_gb:g}GB",
                dram_buffer_bytes=int(self.dram_buffer_gb * GB),
            )
        return ClusterSpec(
            hardware=hw,
            model=model_preset(self.model),
            num_prefill_nodes=num_prefill_nodes or self.num_prefill_nodes,
            num_decode_nodes=num_decode_nodes or self.num_decode_nodes,
        )

    def sim_kwargs(self) -> dict[str, Any]:
        """`SimConfig` fields this setup sets beyond the cluster (none: the roofline model)."""
        return {}

    def workload(self, trace: str, max_len_tokens: int, num_agents: int, seed: int,
                 block_size: int) -> Workload | None:
        """Agents of this setup's own making (None: the Table-2 agents of `trace`)."""
        return None


PROFILE_PREFIX = "profile:"
"""`setup("profile:FILE")`: the cluster of the engine profiled in FILE (`dualpath profile`)."""


@cache
def _profile(path: str) -> Profile:
    return load_profile(path)


@dataclass(frozen=True)
class ProfileSetup(Setup):
    """A profiled engine's cluster: its model, run configuration and measured step costs
    (`plan.step_profile.Profile`), at 1P1D unless P/D are given."""

    profile_path: str = ""

    def cluster(
        self, num_prefill_nodes: int | None = None, num_decode_nodes: int | None = None
    ) -> ClusterSpec:
        return _profile(self.profile_path).cluster(num_prefill_nodes or self.num_prefill_nodes,
                                                   num_decode_nodes or self.num_decode_nodes)

    def sim_kwargs(self) -> dict[str, Any]:
        return _profile(self.profile_path).sim_kwargs()


SETUPS: dict[str, Setup] = {
    s.name: s
    for s in (
        Setup("ds660b_2p4d", "deepseek-v3.2", 2, 4, label="DS 660B (DeepSeek-V3.2) 2P4D"),
        Setup("ds27b_1p1d", "ds-27b", 1, 1, label="DS 27B 1P1D"),
        Setup("qwen32b_1p2d", "qwen2.5-32b", 1, 2, dram_buffer_gb=320.0,
              label="Qwen2.5-32B 1P2D"),
    )
}


def setup(name: str) -> Setup:
    """The named setup, or `MODEL@HARDWARE` for any model and node preset at 1P1D (its
    hardware's DRAM buffer), or `profile:FILE` for a profiled engine's cluster at 1P1D, or
    `cluster:FILE` for a user's cluster and workload (`plan.user_setup`);
    UnknownPresetError lists the valid names."""
    if name.startswith("cluster:"):
        from dualpath.plan.user_setup import user_setup  # it builds on this module

        return user_setup(name)
    if name.startswith(PROFILE_PREFIX):
        path = name[len(PROFILE_PREFIX):]
        prof = _profile(path)
        return ProfileSetup(name, str(prof.model["name"]), 1, 1,
                            prof.run["dram_buffer_bytes"] / GB,
                            label=f"{prof.model['name']} ({prof.data['engine']['kind']} profile "
                            f"{path})", hardware=f"{prof.hardware().name}", profile_path=path)
    if "@" in name:
        model, hw = name.split("@", 1)
        model_preset(model)
        buffer_gb = hardware_preset(hw).dram_buffer_bytes / GB
        return Setup(name, model, 1, 1, buffer_gb, label=f"{model} on {hw}", hardware=hw)
    try:
        return SETUPS[name]
    except KeyError:
        raise UnknownPresetError("setup", name, list(SETUPS)) from None
