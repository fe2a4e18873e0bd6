"""Tiny clusters and workloads the simulator's tests share."""

from __future__ import annotations

from dualpath.core.cluster import ClusterSpec
from dualpath.core.hardware import HardwareSpec, hardware_preset
from dualpath.core.model import model_preset
from dualpath.core.read_rate import storage_read_model
from dualpath.core.units import GB
from dualpath.sim import Driver, SimConfig, SimResult, Workload, simulate

BS = 64


def tiny_cluster(p: int = 1, d: int = 1, snic_gbps: float | None = None) -> ClusterSpec:
    hw = hardware_preset("h800-deepseek")
    if snic_gbps is not None:
        hw = hw.with_overrides(name="h800-slow-storage", storage_nic_bytes_per_s=snic_gbps * GB)
    return ClusterSpec(hw, model_preset("ds-27b"), p, d)


def trajectories(num_agents: int, num_turns: int, append: int, gen: int, first: int) -> Workload:
    """Trajectories with within-trajectory block-aligned hits (paper A.4)."""
    agents = []
    for a in range(num_agents):
        turns, ctx = [], 0
        for t in range(num_turns):
            prompt = ctx + (first + 64 * a if t == 0 else append)
            turns.append((prompt, (ctx // BS) * BS, gen))
            ctx = prompt + gen
        agents.append(turns)
    return Workload.from_lists(agents)


def read_rate(hw: HardwareSpec, kv_bytes_per_token: int) -> float:
    """A storage NIC's KV read rate: the preset's calibrated storage model."""
    return storage_read_model(hw.name).read_bytes_per_s(hw.storage_nic_bytes_per_s,
                                                         kv_bytes_per_token * BS)


def run_offline(cluster: ClusterSpec, wl: Workload, mode: str, **kw: object) -> SimResult:
    cfg = SimConfig(cluster, wl, driver=Driver(num_agents=wl.num_agents), **kw)  # type: ignore[arg-type]
    return simulate(cfg.with_mode(mode))


IO_BOUND = trajectories(num_agents=24, num_turns=6, append=64, gen=4, first=16000)
