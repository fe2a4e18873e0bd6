"""Event kernel ordering and max-min fair bandwidth sharing."""

from __future__ import annotations

import pytest

from dualpath.sim.flows import WIDE_FLOW_HOSTS, WIDE_FLOW_LINKS, Flow, FlowNet, Link
from dualpath.sim.kernel import EventLoop


def test_events_run_in_time_then_schedule_order_and_cancel_drops() -> None:
    loop = EventLoop()
    seen: list[str] = []
    loop.at(2.0, lambda: seen.append("c"))
    loop.at(1.0, lambda: seen.append("a"))
    loop.at(1.0, lambda: seen.append("b"))
    h = loop.at(1.5, lambda: seen.append("x"))
    loop.cancel(h)
    loop.run()
    assert seen == ["a", "b", "c"]
    assert loop.now_s == 2.0


def test_cancelled_events_are_compacted_away_and_the_order_is_kept() -> None:
    loop = EventLoop()
    seen: list[int] = []
    handles = [loop.at(float(k % 97), lambda k=k: seen.append(k)) for k in range(20_000)]
    for k, h in enumerate(handles):
        if k % 10:
            loop.cancel(h)  # 18,000 cancelled: the heap is rebuilt on the way
    assert len(loop._heap) < 20_000 and len(loop._heap) - len(loop._cancelled) == 2_000
    loop.run()
    kept = [k for k in range(20_000) if k % 10 == 0]
    assert seen == sorted(kept, key=lambda k: (k % 97, k))
    assert loop.is_idle


def _link(name: str, cap: float, node: int = 0) -> Link:
    return Link(name, name, node, cap, bin_s=1.0)


def test_two_flows_share_a_link_and_the_survivor_speeds_up() -> None:
    loop = EventLoop()
    net = FlowNet(loop)
    link = _link("l", 10.0)
    done: dict[str, float] = {}
    net.start(Flow([(link, 1.0)], 10.0, lambda: done.setdefault("a", loop.now_s)))
    net.start(Flow([(link, 1.0)], 30.0, lambda: done.setdefault("b", loop.now_s)))
    loop.run()
    # Both at 5/s until a finishes at t=2 (10 bytes); b then has 20 left at 10/s: t=4.
    assert done["a"] == pytest.approx(2.0)
    assert done["b"] == pytest.approx(4.0)
    assert link.bytes_carried == pytest.approx(40.0)
    assert link.peak_utilization == pytest.approx(1.0)


def test_max_min_gives_unbottlenecked_flow_the_leftover() -> None:
    loop = EventLoop()
    net = FlowNet(loop)
    shared, narrow = _link("shared", 10.0), _link("narrow", 2.0)
    f1 = net.start(Flow([(shared, 1.0), (narrow, 1.0)], 100.0, lambda: None))
    f2 = net.start(Flow([(shared, 1.0)], 100.0, lambda: None))
    # f1 is held to 2 by `narrow`; max-min gives f2 the remaining 8 (equal split would give 5).
    assert f1.rate == pytest.approx(2.0)
    assert f2.rate == pytest.approx(8.0)
    assert shared.load_bytes_per_s <= shared.capacity_bytes_per_s + 1e-9


def test_weights_and_capacity_change_are_honoured() -> None:
    loop = EventLoop()
    net = FlowNet(loop)
    dram = _link("dram", 10.0)
    ends: list[float] = []
    net.start(Flow([(dram, 2.0)], 10.0, lambda: ends.append(loop.now_s)))  # 2 bytes per unit
    loop.at(1.0, lambda: net.set_capacity(dram, 20.0))
    loop.run()
    # 5 units/s for 1 s (5 left), then 10 units/s: done at 1.5 s.
    assert ends == [pytest.approx(1.5)]
    assert dram.bytes_carried == pytest.approx(20.0)


def test_wide_flow_is_rerated_only_through_its_bottleneck_and_capacities_hold() -> None:
    """A flow over more than WIDE_FLOW_LINKS links on more than WIDE_FLOW_HOSTS nodes keeps its
    rate when a narrow flow starts on one of its other links (the narrow flow gets what is
    left); when one starts on its bottleneck it is re-rated there, bounded on its other links by
    what their flows leave (they keep their rates); every flow finishes with no link above
    capacity. The same links on one node make an ordinary flow, solved exactly."""
    loop = EventLoop()
    net = FlowNet(loop)
    bottleneck = _link("pe", 10.0)
    fan = [_link(f"de{i}", 10.0, node=1 + i) for i in range(WIDE_FLOW_LINKS)]
    done: list[str] = []
    # Alone it runs at 1 unit/s, set by `pe` (10 bytes per unit); each fan link carries 5.
    wide = net.start(Flow([(bottleneck, 10.0)] + [(lk, 5.0) for lk in fan], 4.0,
                          lambda: done.append("wide")))
    assert WIDE_FLOW_LINKS + 1 > WIDE_FLOW_HOSTS
    assert wide.is_wide and wide.rate == pytest.approx(1.0) and wide.bottleneck is bottleneck
    # A copy on fan link 0 gets what the wide flow leaves there (5 of 10 bytes/s): the wide
    # flow keeps its rate. (Exact max-min would hold both at 10 / (5 + 20) = 0.4 units/s: this
    # is the approximation, and the capacity still holds.)
    copy = net.start(Flow([(fan[0], 20.0)], 2.0, lambda: done.append("copy")))
    assert wide.rate == pytest.approx(1.0)
    assert copy.rate == pytest.approx(0.25)
    # A narrow flow on its bottleneck re-rates it there: `pe` is shared at 10 / (10 + 1) per
    # unit of weight; fan link 0 would allow it 1.0 next to the copy, which keeps 0.25.
    other = net.start(Flow([(bottleneck, 1.0)], 5.0, lambda: done.append("other")))
    assert wide.rate == pytest.approx(10.0 / 11.0) and other.rate == pytest.approx(10.0 / 11.0)
    assert copy.rate == pytest.approx(0.25)
    assert wide.bottleneck is bottleneck
    for link in [bottleneck, *fan]:
        assert link.load_bytes_per_s <= link.capacity_bytes_per_s * (1 + 1e-9)
    loop.run()
    assert sorted(done) == ["copy", "other", "wide"]
    assert bottleneck.bytes_carried == pytest.approx(4.0 * 10.0 + 5.0)
    assert all(lk.peak_utilization <= 1.0 + 1e-9 for lk in [bottleneck, *fan])
    # On one node the same shape is an ordinary flow: the copy re-rates it exactly.
    same_node = [_link(f"e{i}", 10.0) for i in range(WIDE_FLOW_LINKS)]
    narrow = net.start(Flow([(_link("pe2", 10.0), 10.0)] + [(lk, 5.0) for lk in same_node], 4.0,
                            lambda: done.append("narrow")))
    assert not narrow.is_wide
    net.start(Flow([(same_node[0], 20.0)], 2.0, lambda: done.append("copy2")))
    assert narrow.rate == pytest.approx(0.4)


def test_a_change_away_from_saturated_links_skips_the_recompute_and_stays_max_min() -> None:
    loop = EventLoop()
    net = FlowNet(loop)
    x, y, z = _link("x", 10.0), _link("y", 4.0), _link("z", 5.0)
    done: dict[str, float] = {}
    p = net.start(Flow([(x, 1.0), (y, 1.0)], 40.0, lambda: done.setdefault("p", loop.now_s)))
    assert net.num_recomputes == 0  # alone: it runs at its bound, 4
    q = net.start(Flow([(x, 1.0), (y, 1.0)], 40.0, lambda: done.setdefault("q", loop.now_s)))
    assert net.num_recomputes == 1  # y (4) cannot hold both at their bounds: they share it
    assert (p.rate, q.rate) == pytest.approx((2.0, 2.0))
    # x is tight (bounds 4 + 4 + 5 > 10) but carries only 4: r fits at its bound, 5, on links
    # that were not saturated, so nobody else moves and no recompute runs.
    r = net.start(Flow([(x, 1.0), (z, 1.0)], 10.0, lambda: done.setdefault("r", loop.now_s)))
    assert net.num_recomputes == 1
    assert (p.rate, q.rate, r.rate) == pytest.approx((2.0, 2.0, 5.0))
    loop.run()
    # r ends at t=2 leaving x at 4 of 10: not saturated, so again no recompute; p and q stay at
    # 2 on y and end at t=20 together (a recompute after the first, which changes nothing).
    assert done["r"] == pytest.approx(2.0)
    assert done["p"] == pytest.approx(20.0) and done["q"] == pytest.approx(20.0)
    assert net.num_recomputes == 2
    assert x.peak_utilization == pytest.approx(0.9)
