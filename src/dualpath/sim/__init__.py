"""`dualpath.sim`: a discrete-event model of a PD-disaggregated cluster running the real
`dualpath.sched` policies, charging every hop of both KV paths to the hardware carrying it.

    from dualpath.sim import SimConfig, Workload, simulate
    from dualpath.sim.workload import agent_workload
    wl = agent_workload("64k", num_agents=1024)
    result = simulate(SimConfig(cluster, wl, mode=mode_preset("dualpath")))
    result.jct_s, result.summary(), result.write_csv("requests.csv")

Module map (the pipeline is the file list):
    kernel.py     heap of (time, seq, callback); deterministic tie-breaking
    flows.py      links and flows; weighted max-min rates on tight links, recomputed locally
    workload.py   turns as numpy arrays: Table-2 agents, hand-made lists, Mooncake traces
    config.py     frozen SimConfig: cluster, Mode (sched.mode), SimParams, Driver, seed
    state.py      run-time Req, Node (storage-NIC read server, DRAM, buffer), Engine (CNIC, HBM),
                  prefill and decode groups, the TTFT log
    policy.py     the adapter around dualpath.sched's Scheduler (never a policy of its own)
    cluster.py    the topology a SimConfig describes: nodes, engines, links, engine groups
    handlers.py   a turn event by event: DE/PE dispatch, reads, prefill steps, copy-in and
                  persistence, decode epochs, finish
    drivers.py    arrivals (offline, online, trace replay) and the online stop rules
    simulator.py  Simulator / simulate: a cluster, its handlers and a driver on one event loop
    result.py     SimResult: per-request records, JCT, TTFT parts, utilization, balance
"""

from dualpath.sim.config import (
    MODE_PRESETS,
    Driver,
    Mode,
    ReadDiscipline,
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
    "ReadDiscipline",
    "ResourceUsage",
    "SimConfig",
    "SimParams",
    "SimResult",
    "Simulator",
    "Workload",
    "mode_preset",
    "simulate",
]
