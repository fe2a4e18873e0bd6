"""Arrivals (offline, online, trace replay) and the online stop rules."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from sim_cases import tiny_cluster, trajectories

from dualpath.core.cluster import ClusterSpec
from dualpath.core.hardware import hardware_preset
from dualpath.core.model import model_preset
from dualpath.sim import Driver, SimConfig, Workload, simulate
from dualpath.sim.state import TtftLog


def test_online_and_replay_drivers_run() -> None:
    cl = tiny_cluster(1, 1)
    wl = trajectories(6, 3, append=200, gen=10, first=3000)
    on = simulate(SimConfig(cl, wl, driver=Driver(kind="online", num_agents=6,
                                                  agents_per_s=1.0, max_duration_s=1e4)))
    assert on.num_completed == wl.num_turns
    assert len(on.trajectory_jct_s()) == 6
    assert (on.ttst_s > 0).all()
    times = [0.5 * i for i in range(wl.num_turns)]
    rep = simulate(SimConfig(
        cl, replace(wl, arrival_s=np.asarray(times)),
        driver=Driver(kind="replay"),
    ))
    assert rep.num_completed == wl.num_turns
    assert (rep.col("arrive_s") == sorted(times)).all()


def test_mooncake_trace_replays_by_timestamp_with_hits_from_hash_ids() -> None:
    from pathlib import Path

    from dualpath.workload.mooncake import load_mooncake

    path = Path(__file__).parent.parent / "fixtures" / "mooncake_excerpt.jsonl"
    trace = load_mooncake(path)
    wl = Workload.from_mooncake(trace)
    assert (wl.hit_tokens < wl.prompt_tokens).all()
    cl = ClusterSpec(hardware_preset("h800-deepseek"), model_preset("ds-27b"), 1, 1)
    r = simulate(SimConfig(cl, wl, driver=Driver(kind="replay")))
    assert r.num_completed == trace.num_requests
    assert np.allclose(np.sort(r.col("arrive_s")), np.sort(trace.timestamp_s))
    kv = cl.model.kv_bytes_per_token
    assert r.resources["snic_read"].bytes_carried == pytest.approx(
        float(wl.hit_tokens.sum()) * kv, rel=1e-9)


def test_online_stops_when_ttft_exceeds_the_slo() -> None:
    wl = trajectories(8, 4, append=300, gen=20, first=20000)
    cfg = SimConfig(tiny_cluster(1, 1, snic_gbps=0.5), wl,
                    driver=Driver(kind="online", num_agents=8, agents_per_s=50.0,
                                  ttft_limit_s=1.0, max_duration_s=1e5))
    r = simulate(cfg)
    assert r.stop_reason == "ttft_limit"
    assert r.num_completed < wl.num_turns
    assert r.ttft_s.max() > 1.0


def test_online_stops_at_steady_state() -> None:
    wl = trajectories(4, 2, append=200, gen=8, first=2000)
    drv = Driver(kind="online", num_agents=0, agents_per_s=2.0, max_duration_s=1e4,
                 steady_window_s=60.0,
                 steady_lookback_s=120.0, steady_tolerance=0.5)
    r = simulate(SimConfig(tiny_cluster(1, 1), wl, driver=drv, seed=3))
    assert r.stop_reason == "steady_state"
    assert 180.0 <= r.duration_s < 1e4


def test_offline_agents_beyond_the_workload_replay_its_agents_in_turn() -> None:
    wl = trajectories(3, 2, append=200, gen=4, first=2000)
    r = simulate(SimConfig(tiny_cluster(1, 1), wl, driver=Driver(num_agents=7)))
    assert r.num_completed == 7 * 2  # two turns each
    agent, row = r.col("agent").astype(int), r.col("row").astype(int)
    for k in range(7):
        source = k % wl.num_agents
        rows = list(range(int(wl.starts[source]), int(wl.starts[source + 1])))
        assert sorted(row[agent == k]) == rows
        # One turn at a time: each arrives when the agent's previous turn is done.
        arrive, done = r.col("arrive_s")[agent == k], r.col("done_s")[agent == k]
        assert (arrive[1:] >= done[:-1]).all()


def test_the_ttft_log_gives_window_means_and_the_largest_ttft() -> None:
    log = TtftLog()
    for arrived_at, done_at in ((0.0, 1.0), (0.5, 2.5), (2.0, 3.0), (1.0, 7.0)):
        log.add(arrived_at, done_at)
    assert log.mean_ttft_s(0.0, 3.0) == pytest.approx((1.0 + 2.0) / 2)
    assert log.mean_ttft_s(3.0, 7.5) == pytest.approx((1.0 + 6.0) / 2)
    assert log.mean_ttft_s(4.0, 6.0) == 0.0  # no prefill completed in the window
    assert log.max_ttft_s == 6.0
