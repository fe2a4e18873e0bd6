"""Whole simulator runs on tiny real clusters (seconds in total)."""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest
from sim_cases import IO_BOUND, read_rate, run_offline, tiny_cluster, trajectories

from dualpath.sched import cost
from dualpath.sim import Driver, SimConfig, SimParams, Workload, simulate
from dualpath.sim.simulator import Simulator


def test_oracle_le_dualpath_le_basic_when_io_bound() -> None:
    cl = tiny_cluster(1, 1, snic_gbps=2.0)
    jct = {m: run_offline(cl, IO_BOUND, m).jct_s for m in ("oracle", "dualpath", "basic")}
    assert jct["oracle"] <= jct["dualpath"] <= jct["basic"]
    assert jct["dualpath"] < 0.8 * jct["basic"]  # both storage NICs read, not one


def test_more_storage_bandwidth_never_increases_jct() -> None:
    jcts = [run_offline(tiny_cluster(1, 1, snic_gbps=g), IO_BOUND, "dualpath").jct_s
            for g in (1.0, 2.0, 8.0)]
    assert jcts[0] >= jcts[1] >= jcts[2]


def test_same_seed_gives_byte_identical_results() -> None:
    cl = tiny_cluster(1, 1)
    wl = trajectories(8, 4, append=300, gen=20, first=5000)
    cfg = SimConfig(cl, wl, driver=Driver(kind="online", num_agents=8, agents_per_s=2.0,
                                          max_duration_s=500.0), seed=7)
    outs = []
    for _ in range(2):
        buf = io.StringIO()
        simulate(cfg).write_csv(buf)
        outs.append(buf.getvalue())
    assert outs[0] == outs[1]
    other = io.StringIO()
    simulate(replace(cfg, seed=8)).write_csv(other)
    assert other.getvalue() != outs[0]


def test_bad_input_names_the_field_and_value() -> None:
    from dualpath.core.errors import SpecError

    with pytest.raises(SpecError, match=r"hit_tokens\[1\]=100.*multiple of the block size 64"):
        SimConfig(tiny_cluster(), Workload.from_lists([[(500, 0, 1), (700, 100, 1)]]))
    with pytest.raises(SpecError, match=r"hit_tokens\[0\]=900"):
        Workload.from_lists([[(500, 900, 1)]])
    with pytest.raises(SpecError, match=r"mode.paths='both'"):
        replace(SimConfig(tiny_cluster(), IO_BOUND).mode, paths="both")


def test_utilization_series_integrate_to_bytes_carried() -> None:
    cl = tiny_cluster(1, 1)
    r = run_offline(cl, IO_BOUND, "dualpath", params=SimParams(utilization_bin_s=0.5))
    cap = read_rate(cl.hardware, cl.model.kv_bytes_per_token)
    for node, series in enumerate(r.storage_read_series_by_node):
        assert len(series) == int(np.ceil(r.duration_s / 0.5))
        assert max(series) <= 1.0 + 1e-9
        assert sum(series) * 0.5 * cap == pytest.approx(r.storage_read_bytes_by_node[node],
                                                        rel=1e-6)


def test_one_request_on_one_engine_matches_hand_computation() -> None:
    cl = tiny_cluster(1, 1)
    hit, miss, gen = 4096, 64, 3
    wl = Workload.from_lists([[(hit + miss, hit, gen)]])
    sim = Simulator(SimConfig(cl, wl, driver=Driver(num_agents=1)))
    r = sim.run()
    m, hw, c = cl.model, cl.hardware, sim.cluster.coeffs
    kv = m.kv_bytes_per_token
    b = min(hw.compute_nic_bytes_per_s, hw.pcie_bytes_per_s)
    # Equal (empty) read queues: the paper's rule reads on the PE side; the SNIC, at the
    # preset's calibrated read rate, is the narrowest link of the read (DRAM is 10x faster).
    t_read = hit * kv / read_rate(hw, kv)
    # One synchronized step: engine 0 attends, the 7 others only pay the fixed time; FFN is
    # expert-parallel over the 8 engines. The PE CNIC read direction carries the hits twice
    # (to HBM, then to the DE buffer) plus the miss KV, overlapped with compute.
    compute = (cost.prefill_attention_time_s(m, hw, [(hit, miss)], c)
               + cost.prefill_ffn_time_s(m, hw, miss / 8, c) + c.per_step_overhead_s)
    stream = (2 * hit + miss) * kv / b
    t_prefill = t_read + max(compute, stream)
    t_join = t_prefill + (hit + miss) * kv / b  # copy-in: DE buffer -> HBM through the CNIC
    step = cost.decode_step_time_s(m, hw, 1, hit + miss + gen / 2, c)
    rec = r.records
    assert rec["pe_read_tokens"][0] == hit
    assert rec["read_done_s"][0] == pytest.approx(t_read, rel=1e-9)
    assert rec["prefill_done_s"][0] == pytest.approx(t_prefill, rel=1e-9)
    assert rec["decode_join_s"][0] == pytest.approx(t_join, rel=1e-9)
    assert rec["done_s"][0] == pytest.approx(t_join + (gen - 1) * step, rel=1e-9)
    assert r.jct_s == pytest.approx(t_join + (gen - 1) * step, rel=1e-9)
    # The node's one prefill group ran one step: computing for `compute`, in the step (its
    # KV streaming too) for the longer of the two.
    assert r.prefill_compute_share == pytest.approx(compute / r.duration_s, rel=1e-9)
    assert r.prefill_busy_share == pytest.approx(max(compute, stream) / r.duration_s, rel=1e-9)
