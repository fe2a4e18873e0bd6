"""Reports the nodes push (`integrations.vllm.reports`): their engines' state into the policy
and their liveness, without the router polling them.

An engine in a report is up or down as the report says, and its loads are the report's. A node
whose reports stop for `MISSED_REPORTS` of its intervals has its engines marked down; until a
report covers an engine again the poller asks it (`is_covered`), so an engine whose reporter
died but which still answers comes back through its polls. A report older than one already
taken from its node (a lower `seq`) changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from dualpath.integrations.vllm.reports import MISSED_REPORTS, NodeReport
from dualpath.integrations.vllm.router.config import RouterConfig
from dualpath.integrations.vllm.router.failover import Liveness
from dualpath.integrations.vllm.router.policy import InstanceMetrics, RoutePolicy
from dualpath.sched.types import Role

log = logging.getLogger("dualpath.route")

WATCH_S = 0.1
"""How often nodes' report deadlines are checked."""


class Intake:
    """Takes reports and watches their deadlines (see the module docstring)."""

    def __init__(self, cfg: RouterConfig, policy: RoutePolicy, liveness: Liveness,
                 on_change: Callable[[], None]) -> None:
        self.policy = policy
        self.liveness = liveness
        self.on_change = on_change
        m = cfg.manifest
        self.kv_bytes_per_token = m.full_block_bytes / m.block_size
        self.instance_of: dict[str, tuple[Role, int]] = {
            url: (role, i) for role, i, url in cfg.instances()}
        self._covered_until: dict[tuple[Role, int], float] = {}
        """Instance -> when its node's next report is overdue."""
        self._nodes: dict[str, tuple[int, float, list[tuple[Role, int]]]] = {}
        """Node -> (last seq, deadline, its engines in the last report)."""
        self.num_reports = 0
        self.num_stale_reports = 0

    def is_covered(self, role: Role, index: int) -> bool:
        """Whether a report not yet overdue covers the instance (it is not polled)."""
        return self._covered_until.get((role, index), 0.0) > time.monotonic()

    @property
    def num_covered(self) -> int:
        now = time.monotonic()
        return sum(1 for t in self._covered_until.values() if t > now)

    def take(self, report: NodeReport) -> list[str]:
        """A node's report into the policy and the liveness; returns the engines it names
        that this router does not route to."""
        now = time.monotonic()
        last = self._nodes.get(report.node)
        if last is not None and report.seq and report.seq < last[0]:
            self.num_stale_reports += 1
            return []
        self.num_reports += 1
        deadline = now + MISSED_REPORTS * report.interval_s
        unknown = []
        engines = []
        for e in report.engines:
            known = self.instance_of.get(e.url.rstrip("/"))
            if known is None:
                unknown.append(e.url)
                continue
            role, index = known
            engines.append(known)
            self._covered_until[known] = deadline
            if not e.is_up:
                self.liveness.mark_down(role, index, f"node {report.node} reports it down")
                continue
            capacity = None if e.kv_capacity_tokens is None \
                else int(e.kv_capacity_tokens * self.kv_bytes_per_token)
            self.policy.update_metrics(role, index, InstanceMetrics(
                e.running, e.waiting, e.kv_usage, capacity))
            self.liveness.mark_up(role, index, now - 1e-9)
        self._nodes[report.node] = (report.seq, deadline, engines)
        self.on_change()
        return unknown

    def overdue(self) -> int:
        """Mark the engines of nodes whose reports are overdue down; returns how many nodes."""
        now = time.monotonic()
        late = [(node, engines) for node, (_, deadline, engines) in self._nodes.items()
                if deadline <= now]
        for node, engines in late:
            del self._nodes[node]
            log.warning("node %s: no report for %d intervals: its %d engines are taken for "
                        "down until they answer", node, MISSED_REPORTS, len(engines))
            for role, index in engines:
                if self._covered_until.get((role, index), 0.0) <= now:
                    self._covered_until.pop((role, index), None)
                    self.liveness.mark_down(role, index, f"node {node} stopped reporting")
        return len(late)

    async def watch_forever(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            self.overdue()
