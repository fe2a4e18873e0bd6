"""One simulation run: drives `dualpath.sched` policies over a workload on a simulated cluster
and charges every hop of both KV paths to the links that carry it (paper Fig. 4 and §4.2).

A run is three parts on one event loop and flow network:

    cluster.py    the topology the config describes: nodes, engines, links, engine groups
    handlers.py   what happens to a turn, event by event: dispatch, reads, prefill steps,
                  copy-in and persistence, decode epochs, finish
    drivers.py    how turns arrive (offline, online, trace replay) and when a run stops
"""

from __future__ import annotations

import gc
from collections.abc import Callable

from dualpath.sim.config import SimConfig
from dualpath.sim.drivers import drive
from dualpath.sim.flows import FlowNet
from dualpath.sim.handlers import Handlers
from dualpath.sim.kernel import EventLoop
from dualpath.sim.result import SimResult, build_result
from dualpath.sim.sched_adapter import Policy
from dualpath.sim.topology import Cluster

ProgressFn = Callable[[int], None]


class Simulator:
    """One run. Build with a `SimConfig`, call `run()` once; not reusable."""

    def __init__(self, config: SimConfig, progress: ProgressFn | None = None) -> None:
        self.config = config
        self.loop = EventLoop()
        self.net = FlowNet(self.loop)
        self.cluster = Cluster(config)
        self.policy = Policy(config, self.cluster.coeffs, len(self.cluster.dgroups))
        self.cluster.check_requests_fit(config.workload, self.policy.params)
        self.handlers = Handlers(config, self.cluster, self.loop, self.net, self.policy,
                                 progress)
        self.stop_reason = ""
        """Why an online run stopped (set by `run`); "" otherwise."""

    def run(self) -> SimResult:
        """Run to completion (or the online stop rule) and summarize."""
        self.stop_reason = drive(self.config, self.handlers, self.loop)
        return build_result(self.config, self.cluster, self.handlers, self.loop, self.net,
                            self.stop_reason)


def simulate(config: SimConfig, progress: ProgressFn | None = None) -> SimResult:
    """Run one simulation. `progress(n)` is called as turns complete (for a progress bar).

    The cyclic garbage collector is paused for the run: requests, flows and events are freed
    by reference counting, while each of the collector's full passes walks every live object,
    which at the paper's largest scale (millions of requests) is a large share of the run
    (perf). Whatever cycles a run leaves are collected after it. Results do not depend on it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return Simulator(config, progress).run()
    finally:
        if was_enabled:
            gc.enable()
