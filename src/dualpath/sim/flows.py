"""Fluid bandwidth sharing: links with capacities, flows across weighted sets of links, weighted
max-min fair rates recomputed (on the connected component that changed) whenever a flow starts or
ends or a link's capacity changes.

A flow moves `size` units; on link `l` it places `weight_l` bytes per unit, so a flow that crosses
DRAM twice (written by one NIC, read by another) has weight 2 there. All hops of one flow advance
together (a pipelined transfer), which is the fluid view of store-and-forward with small blocks.

Invariant kept by `_recompute`: for every link, sum over its flows of `weight * rate` is at most
its capacity; every flow is bottlenecked on at least one saturated link (max-min fairness).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from dualpath.sim.kernel import EventLoop

_EPS = 1e-12


class Link:
    """One direction of one resource (a NIC direction, a node's DRAM, a storage cluster cap).

    Tracks the load piecewise-constant in time to give bytes carried, busy time, the peak
    load/capacity ratio and a utilization time series in fixed bins.
    """

    __slots__ = (
        "_bins",
        "_load_since_s",
        "bin_s",
        "bytes_carried",
        "capacity_bytes_per_s",
        "flows",
        "kind",
        "load_bytes_per_s",
        "name",
        "node",
        "peak_utilization",
    )

    def __init__(
        self, name: str, kind: str, node: int, capacity_bytes_per_s: float, bin_s: float
    ) -> None:
        self.name = name
        self.kind = kind
        self.node = node
        self.capacity_bytes_per_s = capacity_bytes_per_s
        self.flows: dict[Flow, float] = {}
        self.load_bytes_per_s = 0.0
        self.bytes_carried = 0.0
        self.peak_utilization = 0.0
        self.bin_s = bin_s
        self._bins: list[float] = []
        self._load_since_s = 0.0

    def close_segment(self, now_s: float) -> None:
        """Account the load held since the last change up to `now_s`."""
        t0, load = self._load_since_s, self.load_bytes_per_s
        self._load_since_s = now_s
        if load <= 0.0 or now_s <= t0:
            return
        self.bytes_carried += load * (now_s - t0)
        bins, width = self._bins, self.bin_s
        first, last = int(t0 / width), int(now_s / width)
        if len(bins) <= last:
            bins.extend([0.0] * (last + 1 - len(bins)))
        if first == last:
            bins[first] += load * (now_s - t0)
            return
        bins[first] += load * ((first + 1) * width - t0)
        for b in range(first + 1, last):
            bins[b] += load * width
        bins[last] += load * (now_s - last * width)

    def set_load(self, load_bytes_per_s: float) -> None:
        self.load_bytes_per_s = load_bytes_per_s
        if self.capacity_bytes_per_s > 0:
            u = load_bytes_per_s / self.capacity_bytes_per_s
            if u > self.peak_utilization:
                self.peak_utilization = u

    def utilization_series(self, end_s: float) -> list[float]:
        """Mean utilization (load / capacity) per bin from 0 to `end_s`."""
        n = max(1, math.ceil(end_s / self.bin_s))
        bins = self._bins + [0.0] * max(0, n - len(self._bins))
        cap = self.capacity_bytes_per_s * self.bin_s
        return [b / cap for b in bins[:n]]


class Flow:
    """A transfer of `size` units over weighted links; `on_done` runs when it completes."""

    __slots__ = ("_handle", "_updated_s", "links", "on_done", "rate", "remaining", "size")

    def __init__(
        self, links: Iterable[tuple[Link, float]], size: float, on_done: Callable[[], None]
    ) -> None:
        merged: dict[Link, float] = {}
        for link, weight in links:
            if weight > 0.0:
                merged[link] = merged.get(link, 0.0) + weight
        self.links = merged
        self.size = size
        self.remaining = size
        self.rate = 0.0
        self.on_done = on_done
        self._handle = 0
        self._updated_s = 0.0


class FlowNet:
    """The set of active flows over a set of links, driven by an `EventLoop`."""

    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop
        self.num_recomputes = 0

    def start(self, flow: Flow) -> Flow:
        """Add `flow`; if it has no links or no bytes it completes at once (as an event)."""
        if flow.size <= 0.0 or not flow.links:
            self.loop.after(0.0, flow.on_done)
            return flow
        flow._updated_s = self.loop.now_s
        for link, weight in flow.links.items():
            link.flows[flow] = weight
        self._recompute(list(flow.links))
        return flow

    def set_capacity(self, link: Link, capacity_bytes_per_s: float) -> None:
        """Change a link's capacity (e.g. inference traffic taking the high-priority class)."""
        if capacity_bytes_per_s == link.capacity_bytes_per_s:
            return
        link.close_segment(self.loop.now_s)
        link.capacity_bytes_per_s = capacity_bytes_per_s
        if link.flows:
            self._recompute([link])

    def _finish(self, flow: Flow) -> None:
        flow.remaining = 0.0
        links = list(flow.links)
        for link in links:
            del link.flows[flow]
        self._recompute(links)
        flow.on_done()

    def _recompute(self, seeds: list[Link]) -> None:
        """Weighted max-min (progressive filling) over the component reachable from `seeds`."""
        self.num_recomputes += 1
        now = self.loop.now_s
        links: dict[Link, None] = dict.fromkeys(seeds)
        flows: dict[Flow, None] = {}
        stack = list(seeds)
        while stack:
            link = stack.pop()
            for f in link.flows:
                if f not in flows:
                    flows[f] = None
                    for other in f.links:
                        if other not in links:
                            links[other] = None
                            stack.append(other)
        # Advance every affected flow to `now` at its old rate before rates change.
        old_rates = {}
        for f in flows:
            f.remaining -= f.rate * (now - f._updated_s)
            f._updated_s = now
            old_rates[f] = f.rate
        for link in links:
            link.close_segment(now)
        residual = {link: link.capacity_bytes_per_s for link in links}
        weight_sum = {link: sum(link.flows.values()) for link in links}
        unfrozen = dict(flows)
        level = 0.0
        while unfrozen:
            best, best_link = math.inf, None
            for link, w in weight_sum.items():
                if w > _EPS:
                    x = residual[link] / w
                    if x < best:
                        best, best_link = x, link
            if best_link is None:  # pragma: no cover - every flow has a link
                break
            level = max(level, best)
            for f in [f for f in best_link.flows if f in unfrozen]:
                del unfrozen[f]
                f.rate = level
                for link, w in f.links.items():
                    residual[link] -= w * level
                    weight_sum[link] -= w
            weight_sum[best_link] = 0.0
        for link in links:
            link.set_load(sum(w * f.rate for f, w in link.flows.items()))
        loop = self.loop
        for f, old_rate in old_rates.items():
            if f._handle and f.rate == old_rate:
                continue  # its completion time is unchanged
            if f._handle:
                loop.cancel(f._handle)
            done_s = now + max(f.remaining, 0.0) / f.rate if f.rate > 0 else math.inf
            f._handle = loop.at(done_s, self._finisher(f)) if done_s < math.inf else 0

    def _finisher(self, flow: Flow) -> Callable[[], None]:
        return lambda: self._finish(flow)
