"""How turns arrive and when a run ends (`Driver.kind`):

- `offline`: `num_agents` agents start at once; each agent's next turn arrives when its
  previous one finishes; the run ends when every turn has.
- `online`: agents arrive as a Poisson process of `agents_per_s` (turns chained as offline);
  the run stops at steady state (mean TTFT over the last `steady_window_s` within
  `steady_tolerance` of the window `steady_lookback_s` earlier), when a prefill's TTFT passes
  `ttft_limit_s`, or at `max_duration_s`.
- `replay`: every turn of a trace arrives at its recorded time (none waits for another).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from dualpath.sim.config import Driver, SimConfig
from dualpath.sim.handlers import Handlers
from dualpath.sim.kernel import EventLoop
from dualpath.sim.state import TtftLog


def drive(config: SimConfig, handlers: Handlers, loop: EventLoop) -> str:
    """Start the arrivals, run the event loop until the driver's end; returns why an online
    run stopped (`steady_state`, `ttft_limit`, `max_duration`), else ""."""
    drv = config.driver
    wl = config.workload
    starts: list[int] = wl.starts.tolist()
    if drv.kind == "offline":
        for k in range(drv.num_agents):
            _start_agent(handlers, starts, k % wl.num_agents)
        loop.run()
        return ""
    if drv.kind == "online":
        arrivals = _OnlineArrivals(drv, handlers, loop, starts, random.Random(config.seed))
        arrivals.schedule(0)
        rule = _StopRule(drv, handlers.ttft, loop)
        loop.after(drv.steady_window_s, rule.check_steady)
        loop.run(until_s=drv.max_duration_s, should_stop=rule.should_stop)
        return rule.stop_reason or "max_duration"
    assert wl.arrival_s is not None
    times: list[float] = wl.arrival_s.tolist()
    for k in range(wl.num_agents):
        lo, hi = starts[k], starts[k + 1]
        agent = handlers.add_agent(lo, hi, hi)  # one request per row, no follow-ups
        for row in range(lo, hi):
            loop.at(times[row], _arrival(handlers, agent, row))
    loop.run(until_s=math.inf)
    return ""


def _start_agent(handlers: Handlers, starts: list[int], source: int) -> None:
    """A new agent replaying the turns of workload agent `source`, one after another."""
    lo, hi = starts[source], starts[source + 1]
    handlers.arrive(handlers.add_agent(lo, hi, lo + 1), lo)


def _arrival(handlers: Handlers, agent: int, row: int) -> Callable[[], None]:
    return lambda: handlers.arrive(agent, row)


class _OnlineArrivals:
    """Agent `k` arrives an exponential gap after agent `k - 1` (seeded), up to `num_agents`
    (0: no limit), cycling through the workload's agents."""

    def __init__(self, drv: Driver, handlers: Handlers, loop: EventLoop, starts: list[int],
                 rng: random.Random) -> None:
        self.drv = drv
        self.handlers = handlers
        self.loop = loop
        self.starts = starts
        self.num_sources = len(starts) - 1
        self.rng = rng

    def schedule(self, k: int) -> None:
        drv = self.drv
        if drv.num_agents and k >= drv.num_agents:
            return
        gap = self.rng.expovariate(drv.agents_per_s)
        self.loop.after(gap, lambda: self._arrive(k))

    def _arrive(self, k: int) -> None:
        _start_agent(self.handlers, self.starts, k % self.num_sources)
        self.schedule(k + 1)


class _StopRule:
    """The online run's stop rules over the prefills' TTFTs."""

    def __init__(self, drv: Driver, ttft: TtftLog, loop: EventLoop) -> None:
        self.drv = drv
        self.ttft = ttft
        self.loop = loop
        self.ttft_limit_s = drv.ttft_limit_s if drv.ttft_limit_s > 0 else math.inf
        self.stop_reason = ""

    def should_stop(self) -> bool:
        """Checked after every event."""
        if self.stop_reason:
            return True
        if self.ttft.max_ttft_s > self.ttft_limit_s:
            self.stop_reason = "ttft_limit"
            return True
        return False

    def check_steady(self) -> None:
        """Every fifth of a window: stop once the mean TTFT has settled."""
        drv = self.drv
        now = self.loop.now_s
        if now >= drv.steady_lookback_s + drv.steady_window_s:
            cur = self.ttft.mean_ttft_s(now - drv.steady_window_s, now)
            old = self.ttft.mean_ttft_s(now - drv.steady_lookback_s - drv.steady_window_s,
                                        now - drv.steady_lookback_s)
            if cur > 0 and old > 0 and abs(cur - old) <= drv.steady_tolerance * old:
                self.stop_reason = "steady_state"
                return
        self.loop.after(drv.steady_window_s / 5, self.check_steady)
