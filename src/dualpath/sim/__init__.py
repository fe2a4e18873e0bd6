"""`dualpath.sim`: a discrete-event model of a PD-disaggregated cluster running the real
`dualpath.sched` policies, charging every hop of both KV paths to the hardware carrying it.

    from dualpath.sim import SimConfig, Workload, simulate
    result = simulate(SimConfig(cluster, workload, mode=mode_preset("dualpath")))
    result.jct_s, result.summary(), result.write_csv("requests.csv")
"""

from dualpath.sim.config import (
    MODE_PRESETS,
    Driver,
    Mode,
    SimConfig,
    SimParams,
    mode_preset,
)
from dualpath.sim.result import RECORD_FIELDS, ResourceUsage, SimResult
from dualpath.sim.simulator import Simulator, simulate
from dualpath.sim.workload import Workload

__all__ = [
    "MODE_PRESETS",
    "RECORD_FIELDS",
    "Driver",
    "Mode",
    "ResourceUsage",
    "SimConfig",
    "SimParams",
    "SimResult",
    "Simulator",
    "Workload",
    "mode_preset",
    "simulate",
]
