"""SimParams.turn_dispatch_s / turn_return_s: the control plane's per-turn latencies (a
profile's `run.control_plane`) delay each turn's submission to the scheduler and each agent's
next turn by exactly their amount."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from sim_cases import run_offline, tiny_cluster, trajectories

from dualpath.core.errors import SpecError
from dualpath.sim import SimParams, SimResult


def _by_row(res: SimResult, name: str) -> npt.NDArray[np.float64]:
    order = np.argsort(res.col("row"))
    return res.col(name)[order]


# One agent alone: nothing else on the cluster, so a delay only shifts its turns in time.
ONE = trajectories(num_agents=1, num_turns=3, append=1024, gen=4, first=4096)


@pytest.mark.parametrize("mode", ["oracle", "dualpath"])
def test_return_delays_each_next_turn_by_its_amount(mode: str) -> None:
    cl = tiny_cluster(snic_gbps=0.5)
    params = SimParams(is_next_turn_after_persist=True)
    base = run_offline(cl, ONE, mode, params=params)
    late = run_offline(cl, ONE, mode, params=SimParams(is_next_turn_after_persist=True,
                                                       turn_return_s=0.25))
    assert base.num_completed == late.num_completed == 3
    arrive, base_arrive = _by_row(late, "arrive_s"), _by_row(base, "arrive_s")
    assert arrive[0] == base_arrive[0] == 0.0
    # Each next turn arrives 0.25 s later than it would have, on top of the earlier turns'.
    assert arrive[1:] - base_arrive[1:] == pytest.approx([0.25, 0.5], abs=1e-9)
    assert late.jct_s == pytest.approx(base.jct_s + 0.5, abs=1e-9)
    # The turns themselves take as long as before.
    assert _by_row(late, "done_s") - arrive == pytest.approx(
        _by_row(base, "done_s") - base_arrive, abs=1e-9)


def test_dispatch_delays_each_turn_after_its_arrival() -> None:
    cl = tiny_cluster()
    base = run_offline(cl, ONE, "oracle")
    late = run_offline(cl, ONE, "oracle", params=SimParams(turn_dispatch_s=0.1))
    # Every turn reaches its engines 0.1 s after it arrives: its TTFT and time in the system
    # grow by that, and each next turn (arriving at the last one's end) 0.1 s more.
    assert late.ttft_s == pytest.approx(base.ttft_s + 0.1, abs=1e-9)
    assert _by_row(late, "de_assigned_s") - _by_row(late, "arrive_s") == pytest.approx(
        _by_row(base, "de_assigned_s") - _by_row(base, "arrive_s") + 0.1, abs=1e-9)
    assert _by_row(late, "arrive_s") == pytest.approx([0.0, *(_by_row(late, "done_s")[:2])])
    assert late.jct_s == pytest.approx(base.jct_s + 0.3, abs=1e-9)


def test_many_agents_finish_with_both_delays() -> None:
    wl = trajectories(num_agents=6, num_turns=4, append=512, gen=4, first=2048)
    params = SimParams(is_next_turn_after_persist=True, turn_dispatch_s=0.02,
                       turn_return_s=0.03)
    res = run_offline(tiny_cluster(), wl, "dualpath", params=params)
    assert res.num_completed == res.num_requests == 24


@pytest.mark.parametrize("name", ["turn_dispatch_s", "turn_return_s"])
def test_negative_latency_is_refused(name: str) -> None:
    with pytest.raises(SpecError, match=name):
        SimParams(**{name: -0.1})  # type: ignore[arg-type]
