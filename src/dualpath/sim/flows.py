"""Fluid bandwidth sharing: links with capacities, flows across weighted sets of links, weighted
max-min fair rates recomputed (on the connected component that changed) whenever a flow starts or
ends or a link's capacity changes.

A flow moves `size` units; on link `l` it places `weight_l` bytes per unit, so a flow that crosses
DRAM twice (written by one NIC, read by another) has weight 2 there. All hops of one flow advance
together (a pipelined transfer), which is the fluid view of store-and-forward with small blocks.

Invariant kept by `_recompute`: for every link, sum over its flows of `weight * rate` is at most
its capacity; every flow is bottlenecked on a saturated link or runs at its bound (max-min).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable
from itertools import count

from dualpath.sim.kernel import EventLoop

_EPS = 1e-12


class Link:
    """One direction of one resource (a NIC direction, a node's DRAM, a storage cluster cap).

    Tracks the load piecewise-constant in time to give bytes carried, busy time, the peak
    load/capacity ratio and a utilization time series in fixed bins.
    """

    __slots__ = (
        "_bins",
        "_changed",
        "_inside_load",
        "_load_since_s",
        "_mark",
        "_order",
        "_queued",
        "_residual",
        "_weight",
        "bin_s",
        "bound_load",
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
        self.capacity_bytes_per_s = float(capacity_bytes_per_s)
        self.flows: dict[Flow, float] = {}
        self.load_bytes_per_s = 0.0
        self.bound_load = 0.0
        """Sum over flows of weight * bound: if within capacity the link cannot bind."""
        self.bytes_carried = 0.0
        self.peak_utilization = 0.0
        self.bin_s = bin_s
        self._bins: list[float] = []
        self._load_since_s = 0.0
        # Scratch state of the recompute that last visited this link (see FlowNet._recompute):
        # `_mark` is that recompute's number while the link is in its tight set.
        self._mark = 0
        self._changed = 0
        self._order = 0
        self._weight = 0.0
        self._inside_load = 0.0
        self._residual = 0.0
        self._queued = 0

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

    @property
    def is_tight(self) -> bool:
        """Could bind: its flows, each at its bound, would exceed the capacity."""
        return self.bound_load > self.capacity_bytes_per_s * _TIGHT

    def set_load(self, load_bytes_per_s: float) -> None:
        if load_bytes_per_s < 0.0 or not self.flows:
            load_bytes_per_s = max(0.0, load_bytes_per_s) if self.flows else 0.0
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

    __slots__ = (
        "_cap_link", "_frozen", "_handle", "_limit", "_mark", "_net", "_new_rate", "_updated_s",
        "bottleneck", "bound",
        "is_wide", "links", "on_done", "rate", "remaining", "size",
    )

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
        self.bound = 0.0
        """The rate this flow would get alone: min over its links of capacity / weight."""
        self.bottleneck: Link | None = None
        """The link that set its current rate (the link of its bound when it runs at it)."""
        self.is_wide = len(merged) > WIDE_FLOW_LINKS and _num_hosts(merged) > WIDE_FLOW_HOSTS
        """Crosses more than `WIDE_FLOW_LINKS` links on more than `WIDE_FLOW_HOSTS` nodes:
        re-rated only through its bottleneck."""
        self.on_done = on_done
        self._handle = 0
        self._updated_s = 0.0
        self._mark = 0
        """The number of the recompute whose set holds it (scratch, like `_frozen`)."""
        self._frozen = 0
        self._new_rate = 0.0
        self._limit = 0.0
        """Its bound in the current recompute, lowered for a wide flow by its private links."""
        self._cap_link: Link | None = None
        self._net: FlowNet | None = None
        """The net it runs on (set by `FlowNet.start`)."""

    def __call__(self) -> None:
        """Its completion event: the flow is its own callback (no closure per (re-)rate)."""
        net = self._net
        assert net is not None
        net._finish(self)


class FlowNet:
    """The set of active flows over a set of links, driven by an `EventLoop`.

    Only *tight* links can bind: a link is slack when even every flow on it running at its
    `bound` (the rate it would get alone) stays within capacity, and a slack link is dropped
    from the max-min problem without changing its solution. So a recompute visits only the
    flows connected to the change through tight links, which keeps it local in large clusters.
    """

    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop
        self.num_recomputes = 0

    def start(self, flow: Flow) -> Flow:
        """Add `flow`; if it has no links or no bytes it completes at once (as an event)."""
        links = flow.links
        if flow.size <= 0.0 or not links:
            self.loop.after(0.0, flow.on_done)
            return flow
        now = self.loop.now_s
        flow._updated_s = now
        flow._net = self
        bound_link = _bound_link(flow)
        assert bound_link is not None  # links is not empty
        bound = bound_link.capacity_bytes_per_s / links[bound_link]
        flow.bound = bound
        flow.bottleneck = bound_link
        fits = True
        for link, w in links.items():
            link.flows[flow] = w
            link.bound_load += w * bound
            cap = link.capacity_bytes_per_s
            if link.bound_load > cap * _TIGHT and link.load_bytes_per_s + w * bound > cap:
                fits = False
        if not fits:
            # Other flows can only slow down on links this one made (or found) tight.
            self._recompute([flow], [lk for lk in links if lk.is_tight])
            return flow
        # Fast path: every link is slack (even all its flows at their bounds fit) or has room
        # for this flow at its bound. Then no link it crosses was saturated, so no other flow's
        # bottleneck is among them: the others keep their rates and the new flow runs at its
        # bound, which is the max-min solution with it added.
        flow.rate = bound
        for link, w in links.items():
            if link.load_bytes_per_s > 0.0:
                link.close_segment(now)
            else:
                link._load_since_s = now
            load = link.load_bytes_per_s + w * bound
            link.load_bytes_per_s = load
            u = load / link.capacity_bytes_per_s
            if u > link.peak_utilization:
                link.peak_utilization = u
        flow._handle = self.loop.at(now + flow.remaining / bound, flow)
        return flow

    def set_capacity(self, link: Link, capacity_bytes_per_s: float) -> None:
        """Change a link's capacity (e.g. inference traffic taking the high-priority class)."""
        if capacity_bytes_per_s == link.capacity_bytes_per_s:
            return
        link.close_segment(self.loop.now_s)
        link.capacity_bytes_per_s = capacity_bytes_per_s
        seeds: dict[Link, None] = {link: None}
        for f in link.flows:
            bound = min(lk.capacity_bytes_per_s / w for lk, w in f.links.items())
            for lk, w in f.links.items():
                lk.bound_load += w * (bound - f.bound)
                seeds[lk] = None
            f.bound = bound
        if link.flows:
            self._recompute(list(link.flows), list(seeds))

    def _finish(self, flow: Flow) -> None:
        now = self.loop.now_s
        flow.remaining = 0.0
        # Only flows on links that were tight can speed up when this one leaves, and only if one
        # of its links was saturated: a flow's rate is set by its bound or by a saturated link,
        # so freeing capacity on links below capacity changes no other flow's max-min rate.
        tight: list[Link] = []
        is_saturating = False
        bound, rate = flow.bound, flow.rate
        for link, w in flow.links.items():
            if link.bound_load > link.capacity_bytes_per_s * _TIGHT:
                tight.append(link)
                if link.load_bytes_per_s >= link.capacity_bytes_per_s * _SATURATED:
                    is_saturating = True
            flows = link.flows
            del flows[flow]
            link.close_segment(now)
            if flows:
                link.bound_load -= w * bound
                load = link.load_bytes_per_s - w * rate
                link.load_bytes_per_s = load if load > 0.0 else 0.0
            else:
                link.bound_load = 0.0
                link.load_bytes_per_s = 0.0
        flow.rate = 0.0
        if is_saturating:
            self._recompute([], tight)
        flow.on_done()

    def _recompute(self, seed_flows: list[Flow], seeds: list[Link]) -> None:
        """Weighted max-min (progressive filling with per-flow bounds) over `seed_flows` and
        the flows reachable from `seeds` through tight links; only flows whose rate changes
        are touched after.

        The set is capped at `MAX_COMPONENT_FLOWS` flows (breadth first from the change):
        flows beyond it keep their rates and their load is taken off the links' capacity, so
        capacities always hold; the rates are then max-min within the set, which is exact
        whenever the tight component is smaller than the cap (bursts of thousands of flows
        would otherwise make every start and end cost the whole cluster). Wide flows join
        and bind as `WIDE_FLOW_HOSTS` describes.

        Membership and per-link sums live in the links' and flows' scratch slots, marked with
        this recompute's number (no dicts keyed by links or flows: attribute reads are what
        the compiled build does fastest); every sum is taken in the same order as before.
        """
        self.num_recomputes += 1
        ep = next(_RECOMPUTES)
        now = self.loop.now_s
        flows: list[Flow] = []
        for f in seed_flows:
            if f._mark != ep:
                f._mark = ep
                flows.append(f)
        num_seed_flows = len(flows)
        tight: list[Link] = []
        queue: deque[Link] = deque()
        for link in seeds:
            for f in link.flows:
                if f._mark != ep and (not f.is_wide or f.bottleneck is link):
                    f._mark = ep
                    flows.append(f)
        # A wide flow that joined through its bottleneck brings its tight links into the
        # problem (they bound it) but the search does not spread through them.
        for k, f in enumerate(list(flows)):
            _take_tight_links(f, k < num_seed_flows or not f.is_wide, ep, tight, queue)
        while queue and len(flows) < MAX_COMPONENT_FLOWS:
            link = queue.popleft()
            for f in link.flows:
                if f._mark != ep and (not f.is_wide or f.bottleneck is link):
                    f._mark = ep
                    flows.append(f)
                    _take_tight_links(f, not f.is_wide, ep, tight, queue)
        if not flows:
            return
        # Residual capacity for the set: the capacity minus the load of flows outside it.
        # (Summed over the set's flows, not over each link's flows: a link crossed by many wide
        # flows outside the set costs nothing.)
        for i, link in enumerate(tight):
            link._order = i
            link._weight = 0.0
            link._inside_load = 0.0
        for f in flows:
            rate = f.rate
            for link, w in f.links.items():
                if link._mark == ep:
                    link._weight += w
                    link._inside_load += w * rate
        for link in tight:
            outside = link.load_bytes_per_s - link._inside_load
            link._residual = link.capacity_bytes_per_s - (outside if outside > 0.0 else 0.0)
        # A tight link that only one wide flow of the set crosses saturates exactly when that
        # flow reaches residual / weight there: fold such private links into the flow's limit
        # instead of the progressive filling (hundreds of them per wide flow in large clusters).
        for f in flows:
            limit = f.bound
            f._cap_link = None
            if f.is_wide:
                for link, w in f.links.items():
                    if link._mark == ep and link._weight == w:
                        level = link._residual / w
                        if level < limit:
                            limit = level
                            f._cap_link = link
                        link._weight = 0.0
            f._limit = limit
        frozen_in_order: list[Flow] = []
        by_bound = sorted(flows, key=_limit_key)
        nb = 0
        # Min-heap of (fill level at which the link saturates, order, link). Freezing a flow at
        # a level no higher than a link's entry never lowers that link's level, so stale
        # entries are only ever too low: re-push them with the current level when they surface.
        # (A few links are scanned instead: the same choice, the lowest level and then the
        # lowest order, without the heap's tuples.)
        is_scan = len(tight) <= SCAN_LINKS
        heap: list[tuple[float, int, Link]] = []
        if not is_scan:
            heap = [(lk._residual / lk._weight, lk._order, lk) for lk in tight
                    if lk._weight > _EPS]
            heapq.heapify(heap)
        num_flows = len(flows)
        while len(frozen_in_order) < num_flows:
            best, best_link = math.inf, None
            if is_scan:
                for link in tight:
                    w = link._weight
                    if w > _EPS:
                        cur = link._residual / w
                        if cur < best:
                            best, best_link = cur, link
            while heap:
                x, i, link = heap[0]
                w = link._weight
                if w <= _EPS:
                    heapq.heappop(heap)
                    continue
                cur = link._residual / w
                if cur != x:
                    heapq.heapreplace(heap, (cur, i, link))
                    continue
                best, best_link = x, link
                break
            while nb < len(by_bound) and by_bound[nb]._frozen == ep:
                nb += 1
            at: Link | None = None
            if nb < len(by_bound) and by_bound[nb]._limit <= best:
                frozen = [by_bound[nb]]
                level = by_bound[nb]._limit
            elif best_link is not None:
                frozen = [f for f in best_link.flows if f._mark == ep and f._frozen != ep]
                level = best
                at = best_link
            else:  # pragma: no cover - the bound of every flow is finite
                break
            for f in frozen:
                f._frozen = ep
                f._new_rate = level
                frozen_in_order.append(f)
                if f.is_wide:
                    if at is not None:
                        f.bottleneck = at
                    else:
                        f.bottleneck = f._cap_link if f._cap_link is not None else _bound_link(f)
                for link, w in f.links.items():
                    if link._mark == ep:
                        link._residual -= w * level
                        link._weight -= w
            if best_link is not None and not frozen:
                best_link._weight = 0.0
        loop = self.loop
        changed: list[Link] = []
        for f in frozen_in_order:
            rate = f._new_rate
            old = f.rate
            if f._handle and rate == old:
                continue  # its completion time is unchanged
            f.remaining -= old * (now - f._updated_s)
            f._updated_s = now
            f.rate = rate
            if rate != old:
                for link, w in f.links.items():
                    if link._changed != ep:
                        link._changed = ep
                        changed.append(link)
                        link.close_segment(now)
                    link.load_bytes_per_s += w * (rate - old)
            if f._handle:
                loop.cancel(f._handle)
            done_s = now + max(f.remaining, 0.0) / rate if rate > 0 else math.inf
            f._handle = loop.at(done_s, f) if done_s < math.inf else 0
        # Peaks are checked only once every rate of this recompute is applied.
        for link in changed:
            link.set_load(link.load_bytes_per_s)


_TIGHT = 1.0 + 1e-9
_SATURATED = 1.0 - 1e-9
_RECOMPUTES = count(1)
"""Numbers recomputes across all nets (so scratch marks never collide between two nets)."""
MAX_COMPONENT_FLOWS = 64
SCAN_LINKS = 32
"""Up to this many tight links, a recompute finds the next saturating link by a scan, not a heap."""
WIDE_FLOW_LINKS = 32
WIDE_FLOW_HOSTS = 5
"""A flow across more than `WIDE_FLOW_LINKS` links on more than `WIDE_FLOW_HOSTS` nodes (a
prefill step whose KV goes to decode engines on many nodes) is *wide*: it joins a recompute only
as a seed (its own start and end) or through its bottleneck link, the link that set its rate
last. It then brings its tight links into the problem (they bound it, with the load of the flows
on them that stay outside) but the search does not spread through them. So on its other links
it keeps its rate and the flows there get what it leaves, and it gets what they leave when it is
re-rated: capacities always hold, and the rates are max-min up to that.

Without the rule, a copy or persist starting on any decode engine re-rated every step crossing
it and, through each step's links, the copies and persists of every other engine it reaches:
at 12P24D with 12K agents, recomputes of up to 64 flows over thousands of flow-link pairs slowed
the run to under 2k turns per CPU-second by its middle. A step's flow spans at most one prefill
node and four decode nodes in a 2P4D cluster (or any smaller one), so those never have a wide
flow and their results are exact."""


def _take_tight_links(
    f: Flow, spreads: bool, ep: int, tight: list[Link], queue: deque[Link]
) -> None:
    """Add `f`'s tight links to recompute `ep`'s tight set and, if the search `spreads`
    through `f`, to its queue (each link once to each)."""
    for link in f.links:
        if link.bound_load > link.capacity_bytes_per_s * _TIGHT:
            if link._mark != ep:
                link._mark = ep
                tight.append(link)
            if spreads and link._queued != ep:
                link._queued = ep
                queue.append(link)


def _num_hosts(links: dict[Link, float]) -> int:
    """Distinct nodes among `links` (the cluster-wide storage cap, node -1, is not one)."""
    return len({link.node for link in links if link.node >= 0})


def _limit_key(f: Flow) -> float:
    return f._limit


def _bound_link(f: Flow) -> Link | None:
    """The first link of `f` with the least capacity / weight (the link that sets its bound)."""
    best, out = math.inf, None
    for link, w in f.links.items():
        x = link.capacity_bytes_per_s / w
        if x < best:
            best, out = x, link
    return out
