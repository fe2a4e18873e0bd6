"""Simulator invariants on tiny real clusters (seconds in total)."""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest

from dualpath.core.analysis import analyze
from dualpath.core.cluster import ClusterSpec
from dualpath.core.hardware import HardwareSpec, hardware_preset
from dualpath.core.model import model_preset
from dualpath.core.storage import storage_read_model
from dualpath.core.units import GB
from dualpath.sched import cost
from dualpath.sched.params import derive_scheduler_params
from dualpath.sim import Driver, SimConfig, SimParams, SimResult, Workload, simulate
from dualpath.sim.simulator import Simulator

BS = 64


def _cluster(p: int = 1, d: int = 1, snic_gbps: float | None = None) -> ClusterSpec:
    hw = hardware_preset("h800-deepseek")
    if snic_gbps is not None:
        hw = hw.with_overrides(name="h800-slow-storage", storage_nic_bytes_per_s=snic_gbps * GB)
    return ClusterSpec(hw, model_preset("ds-27b"), p, d)


def _agents(num_agents: int, num_turns: int, append: int, gen: int, first: int) -> Workload:
    """Trajectories with within-trajectory block-aligned hits (paper A.4)."""
    agents = []
    for a in range(num_agents):
        turns, ctx = [], 0
        for t in range(num_turns):
            prompt = ctx + (first + 64 * a if t == 0 else append)
            turns.append((prompt, (ctx // BS) * BS, gen))
            ctx = prompt + gen
        agents.append(turns)
    return Workload.from_lists(agents)


def _read_rate(hw: HardwareSpec, kv_bytes_per_token: int) -> float:
    """A storage NIC's KV read rate: the preset's calibrated storage model."""
    return storage_read_model(hw.name).read_bytes_per_s(hw.storage_nic_bytes_per_s,
                                                         kv_bytes_per_token * BS)


def _run(cluster: ClusterSpec, wl: Workload, mode: str, **kw: object) -> SimResult:
    cfg = SimConfig(cluster, wl, driver=Driver(num_agents=wl.num_agents), **kw)  # type: ignore[arg-type]
    return simulate(cfg.with_mode(mode))


IO_BOUND = _agents(num_agents=24, num_turns=6, append=64, gen=4, first=16000)


def test_storage_bytes_equal_hit_tokens_times_kv_bytes_and_capacities_hold() -> None:
    cl = _cluster(1, 2)
    r = _run(cl, IO_BOUND, "dualpath")
    assert r.num_completed == IO_BOUND.num_turns
    hits = float(IO_BOUND.hit_tokens.sum())
    kv = cl.model.kv_bytes_per_token
    assert r.resources["snic_read"].bytes_carried == pytest.approx(hits * kv, rel=1e-9)
    assert sum(r.storage_read_bytes_by_node) == pytest.approx(hits * kv, rel=1e-9)
    read = r.col("pe_read_tokens") + r.col("de_read_tokens")
    assert (read == r.col("hit_tokens")).all()
    for kind, usage in r.resources.items():
        assert usage.peak_utilization <= 1.0 + 1e-9, kind


@pytest.mark.parametrize("mode", ["basic", "dualpath", "split"])
def test_pe_first_order_binds_the_pe_first_and_reads_every_hit_once(mode: str) -> None:
    cl = _cluster(1, 2)
    # One sequence per decode engine (16 for 24 agents): requests wait for a DE, so the
    # order shows in the times.
    params = derive_scheduler_params(cl.model, cl.hardware, max_seqs_per_decode_engine=1)
    pe_first = _run(cl, IO_BOUND, mode, scheduler=params.with_overrides(
        assignment_order="pe-first"))
    de_first = _run(cl, IO_BOUND, mode, scheduler=params)
    for r in (pe_first, de_first):
        assert r.num_completed == IO_BOUND.num_turns
        read = r.col("pe_read_tokens") + r.col("de_read_tokens")
        assert (read == r.col("hit_tokens")).all()
        assert bool(r.col("de_read_tokens").sum() > 0) == (mode != "basic")
    pe_s, de_s = pe_first.col("pe_assigned_s"), pe_first.col("de_assigned_s")
    assert (pe_s <= de_s).all() and (pe_s < de_s).any()
    assert (de_first.col("de_assigned_s") <= de_first.col("pe_assigned_s")).all()


def test_zero_hits_means_zero_reads() -> None:
    wl = Workload.from_lists([[(3000, 0, 5), (4000, 0, 5)], [(2000, 0, 3)]])
    r = _run(_cluster(), wl, "dualpath")
    assert r.num_completed == 3
    assert r.resources["snic_read"].bytes_carried == 0.0
    assert sum(r.storage_read_bytes_by_node) == 0.0


def test_oracle_le_dualpath_le_basic_when_io_bound() -> None:
    cl = _cluster(1, 1, snic_gbps=2.0)
    jct = {m: _run(cl, IO_BOUND, m).jct_s for m in ("oracle", "dualpath", "basic")}
    assert jct["oracle"] <= jct["dualpath"] <= jct["basic"]
    assert jct["dualpath"] < 0.8 * jct["basic"]  # both storage NICs read, not one


def test_more_storage_bandwidth_never_increases_jct() -> None:
    jcts = [_run(_cluster(1, 1, snic_gbps=g), IO_BOUND, "dualpath").jct_s for g in (1.0, 2.0, 8.0)]
    assert jcts[0] >= jcts[1] >= jcts[2]


def test_same_seed_gives_byte_identical_results() -> None:
    cl = _cluster(1, 1)
    wl = _agents(8, 4, append=300, gen=20, first=5000)
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


def test_one_request_on_one_engine_matches_hand_computation() -> None:
    cl = _cluster(1, 1)
    hit, miss, gen = 4096, 64, 3
    wl = Workload.from_lists([[(hit + miss, hit, gen)]])
    sim = Simulator(SimConfig(cl, wl, driver=Driver(num_agents=1)))
    r = sim.run()
    m, hw, c = cl.model, cl.hardware, sim.coeffs
    kv = m.kv_bytes_per_token
    b = min(hw.compute_nic_bytes_per_s, hw.pcie_bytes_per_s)
    # Equal (empty) read queues: the paper's rule reads on the PE side; the SNIC, at the
    # preset's calibrated read rate, is the narrowest link of the read (DRAM is 10x faster).
    t_read = hit * kv / _read_rate(hw, kv)
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


def test_link_loads_follow_the_papers_accounting() -> None:
    """Per hop, bytes on each resource kind are the §4.2 charges of the reads that happened:
    with R_p bytes read on PE nodes and R_d on DE nodes (misses and persistence ~0),
    PE CNIC read 2R_p, PE CNIC write R_p+R_d, DE CNIC read R_p+2R_d, DE CNIC write 2R_p+R_d,
    PE DRAM 2R_p, DE DRAM 2R_p+3R_d; with R_p = P*sB and R_d = D*sB per second these are
    exactly `core.analysis`'s loads times the number of links."""
    cl = _cluster(1, 2)
    # prompt = hit + 1, gen = 1: one miss token, nothing new to persist.
    agents = [[(BS * (40 + 8 * a) + 1, BS * (40 + 8 * a), 1)] for a in range(32)]
    r = _run(cl, Workload.from_lists(agents), "dualpath")
    kv = cl.model.kv_bytes_per_token
    nodes = r.storage_read_bytes_by_node
    rp, rd = sum(nodes[:1]), sum(nodes[1:])
    assert rp > 0 and rd > 0  # both paths used
    miss = 32 * kv
    got = {k: u.bytes_carried for k, u in r.resources.items()}
    want = {
        "pe_cnic_read": 2 * rp, "pe_cnic_write": rp + rd, "de_cnic_read": rp + 2 * rd,
        "de_cnic_write": 2 * rp + rd, "pe_dram": 2 * rp, "de_dram": 2 * rp + 3 * rd,
    }
    for kind, value in want.items():
        assert got[kind] == pytest.approx(value, abs=3 * miss), kind
    # The same charges at full storage rate are core.analysis's per-link loads.
    hw, p, d = cl.hardware, cl.num_prefill_nodes, cl.num_decode_nodes
    sb, g = hw.storage_nic_bytes_per_s, hw.gpus_per_node
    full_rp, full_rd = p * sb, d * sb
    per_kind = {c.name: c.load_bytes_per_s for c in analyze(hw, p, d).constraints}
    assert per_kind["pe_cnic_read"] * p * g == pytest.approx(2 * full_rp)
    assert per_kind["pe_cnic_write"] * p * g == pytest.approx(full_rp + full_rd)
    assert per_kind["de_cnic_read"] * d * g == pytest.approx(full_rp + 2 * full_rd)
    assert per_kind["de_cnic_write"] * d * g == pytest.approx(2 * full_rp + full_rd)
    assert per_kind["pe_dram"] * p == pytest.approx(2 * full_rp)
    assert per_kind["de_dram"] * d == pytest.approx(2 * full_rp + 3 * full_rd)


def test_unbalanced_attention_shows_as_bubbles_in_a_synchronized_group() -> None:
    # One long prompt on one engine of the node: the others wait at the FFN sync.
    wl = Workload.from_lists([[(30000, 0, 2)], [(200, 0, 2)]])
    r = _run(_cluster(1, 1), wl, "basic")
    assert r.attention_max_over_avg > 2.0
    dense = _run(_cluster(1, 1), wl, "basic", params=SimParams(is_group_synchronized=False))
    assert dense.attention_max_over_avg == 1.0  # no group: no bubble metric


def test_online_and_replay_drivers_run() -> None:
    cl = _cluster(1, 1)
    wl = _agents(6, 3, append=200, gen=10, first=3000)
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


def test_reads_wait_for_dram_buffer_room() -> None:
    hw = hardware_preset("h800-deepseek")
    kv = model_preset("ds-27b").kv_bytes_per_token
    largest = int(IO_BOUND.hit_tokens.max()) * kv
    small = hw.with_overrides(name="small-buffer", dram_buffer_bytes=int(1.5 * largest))
    cl = ClusterSpec(small, model_preset("ds-27b"), 1, 1)
    r = _run(cl, IO_BOUND, "dualpath")
    assert r.num_completed == IO_BOUND.num_turns
    assert max(r.buffer_peak_bytes_by_node) <= small.dram_buffer_bytes
    roomy = _run(_cluster(1, 1), IO_BOUND, "dualpath")
    assert max(roomy.buffer_peak_bytes_by_node) > small.dram_buffer_bytes


def test_inference_traffic_slows_kv_transfers_but_never_overloads_a_nic() -> None:
    cl = _cluster(1, 1)
    base = _run(cl, IO_BOUND, "dualpath")
    busy = _run(cl, IO_BOUND, "dualpath", params=SimParams(inference_load_fraction=0.98))
    assert busy.jct_s >= base.jct_s
    assert busy.num_completed == IO_BOUND.num_turns
    for kind, usage in busy.resources.items():
        assert usage.peak_utilization <= 1.0 + 1e-9, kind


def test_online_stops_when_ttft_exceeds_the_slo() -> None:
    wl = _agents(8, 4, append=300, gen=20, first=20000)
    cfg = SimConfig(_cluster(1, 1, snic_gbps=0.5), wl,
                    driver=Driver(kind="online", num_agents=8, agents_per_s=50.0,
                                  ttft_limit_s=1.0, max_duration_s=1e5))
    r = simulate(cfg)
    assert r.stop_reason == "ttft_limit"
    assert r.num_completed < wl.num_turns
    assert r.ttft_s.max() > 1.0


def test_bad_input_names_the_field_and_value() -> None:
    from dualpath.core.errors import SpecError

    with pytest.raises(SpecError, match=r"hit_tokens\[1\]=100.*multiple of the block size 64"):
        SimConfig(_cluster(), Workload.from_lists([[(500, 0, 1), (700, 100, 1)]]))
    with pytest.raises(SpecError, match=r"hit_tokens\[0\]=900"):
        Workload.from_lists([[(500, 900, 1)]])
    with pytest.raises(SpecError, match=r"mode.paths='both'"):
        replace(SimConfig(_cluster(), IO_BOUND).mode, paths="both")


def test_online_stops_at_steady_state() -> None:
    wl = _agents(4, 2, append=200, gen=8, first=2000)
    drv = Driver(kind="online", num_agents=0, agents_per_s=2.0, max_duration_s=1e4,
                 steady_window_s=60.0,
                 steady_lookback_s=120.0, steady_tolerance=0.5)
    r = simulate(SimConfig(_cluster(1, 1), wl, driver=drv, seed=3))
    assert r.stop_reason == "steady_state"
    assert 180.0 <= r.duration_s < 1e4


def test_utilization_series_integrate_to_bytes_carried() -> None:
    cl = _cluster(1, 1)
    r = _run(cl, IO_BOUND, "dualpath", params=SimParams(utilization_bin_s=0.5))
    cap = _read_rate(cl.hardware, cl.model.kv_bytes_per_token)
    for node, series in enumerate(r.storage_read_series_by_node):
        assert len(series) == int(np.ceil(r.duration_s / 0.5))
        assert max(series) <= 1.0 + 1e-9
        assert sum(series) * 0.5 * cap == pytest.approx(r.storage_read_bytes_by_node[node],
                                                        rel=1e-6)


def test_a_turn_no_decode_engine_can_hold_is_refused_up_front() -> None:
    from dualpath.core.errors import SpecError

    cl = ClusterSpec(hardware_preset("h800-deepseek").with_overrides(hbm_bytes=40 * GB),
                     model_preset("qwen2.5-32b"), 1, 1)
    # Qwen KV is 256 KiB/token: 40 GB x 0.9 - 33 GB of weights leaves room for ~11k tokens.
    wl = _agents(num_agents=1, num_turns=1, append=64, gen=4, first=20_000)
    with pytest.raises(SpecError, match="decode-engine HBM"):
        _run(cl, wl, "dualpath")
    small = _agents(num_agents=1, num_turns=2, append=64, gen=4, first=2_000)
    r = _run(cl, small, "dualpath")
    assert r.stop_reason == "completed" and r.num_completed == small.num_turns


def test_expert_parallel_groups_set_the_weight_shard_each_decode_step_reads() -> None:
    cluster = _cluster(1, 2)  # ds-27b is MoE; 16 decode engines
    assert cluster.model.is_moe and cluster.num_decode_engines == 16
    wl = _agents(4, 2, append=200, gen=16, first=2000)

    def run(decode_ep: int) -> SimResult:
        return _run(cluster, wl, "dualpath", params=SimParams(decode_ep_engines=decode_ep))

    def csv(r: SimResult) -> str:
        out = io.StringIO()
        r.write_csv(out)
        return out.getvalue()

    def tpot(r: SimResult) -> float:
        stats = r.summary()["tpot_s"]
        assert isinstance(stats, dict)
        return float(stats["mean"])

    whole, same, clamped, small = run(0), run(16), run(1000), run(2)
    # 0 means the whole decode side: the same run as naming all 16 (or more) engines.
    assert csv(same) == csv(whole) == csv(clamped)
    # Groups of 2 each hold and read an eighth of the weights instead of a sixteenth per step.
    assert tpot(small) > 1.05 * tpot(whole)
    from dualpath.core.errors import SpecError

    with pytest.raises(SpecError, match="decode_ep_engines"):
        SimParams(decode_ep_engines=-1)


def test_hbm_reserve_comes_from_the_cost_coefficients_unless_the_params_set_it() -> None:
    # 96 agents of ~30K tokens (21 KB each) on one decode node: 8 engines x (80 GB x 0.1 -
    # 3.4 GB weight share) hold ~7 of them each at a 90% reserve, all of them at 10%.
    cluster = _cluster(1, 1)
    wl = _agents(96, 2, append=200, gen=2000, first=30000)

    def csv(r: SimResult) -> str:
        out = io.StringIO()
        r.write_csv(out)
        return out.getvalue()

    default = _run(cluster, wl, "oracle")
    assert csv(default) == csv(_run(cluster, wl, "oracle",
                                    params=SimParams(hbm_reserve_fraction=0.1)))
    by_coeff = _run(cluster, wl, "oracle", cost_overrides=(("hbm_reserve_fraction", 0.9),))
    by_param = _run(cluster, wl, "oracle", params=SimParams(hbm_reserve_fraction=0.9))
    assert csv(by_coeff) == csv(by_param)
    # The params win over the coefficients.
    both = _run(cluster, wl, "oracle", cost_overrides=(("hbm_reserve_fraction", 0.9),),
                params=SimParams(hbm_reserve_fraction=0.1))
    assert csv(both) == csv(default)
    # Fewer sequences per decode engine: turns wait for HBM, and the run takes longer.
    assert by_coeff.jct_s > 1.5 * default.jct_s
    from dualpath.core.errors import SpecError

    with pytest.raises(SpecError, match="hbm_reserve_fraction"):
        SimParams(hbm_reserve_fraction=1.0)


def test_sequence_cap_per_decode_engine_limits_concurrency_like_a_smaller_hbm() -> None:
    from dualpath.sched.cost import coefficients_for
    from dualpath.sched.params import derive_scheduler_params

    cluster = _cluster(1, 1)
    wl = _agents(96, 2, append=200, gen=2000, first=30000)
    base = derive_scheduler_params(cluster.model, cluster.hardware,
                                   coefficients_for(cluster.model, cluster.hardware),
                                   max_seqs_per_decode_engine=0)
    free = _run(cluster, wl, "oracle", scheduler=base)
    capped = _run(cluster, wl, "oracle",
                  scheduler=base.with_overrides(max_seqs_per_decode_engine=6))
    # 8 engines x 6 sequences hold half of the 96 agents: turns wait for a slot.
    assert capped.num_completed == free.num_completed == wl.num_turns
    assert capped.jct_s > 1.5 * free.jct_s
    breakdown = capped.summary()["ttft_breakdown_s"]
    assert isinstance(breakdown, dict) and breakdown["allocation"] > 1.0
    # The cap of the cost coefficients (what calibration fits) reaches the scheduler the same way.
    by_coeff = _run(cluster, wl, "oracle", cost_overrides=(("max_seqs_per_decode_engine", 6),))
    assert by_coeff.jct_s == capped.jct_s


def test_basic_reads_wait_for_pe_hbm_room_for_the_whole_prompt() -> None:
    """Without layerwise prefill a PE-side read lands in its engine's HBM, which holds the
    request's whole KV until it has left for the DE; layerwise reads hold none."""
    kv = model_preset("ds-27b").kv_bytes_per_token
    largest = int(IO_BOUND.prompt_tokens.max()) * kv
    hw = hardware_preset("h800-deepseek")
    weights = model_preset("ds-27b").weight_bytes / hw.gpus_per_node  # EP over the one PE node
    room = 2.5 * largest
    small = hw.with_overrides(name="small-hbm", hbm_bytes=int((room + weights) / 0.9))
    cl = ClusterSpec(small, model_preset("ds-27b"), 1, 1)
    for mode, gated in (("basic", True), ("layerwise", False)):
        sim = Simulator(SimConfig(cl, IO_BOUND, driver=Driver(num_agents=IO_BOUND.num_agents),
                                  params=SimParams(hbm_reserve_fraction=0.1)).with_mode(mode))
        assert sim.pe_hbm_kv_bytes == pytest.approx(room, rel=1e-6)
        result = sim.run()
        assert result.num_completed == IO_BOUND.num_turns
        pes = [e for e in sim.engines if sim.nodes[e.node].is_prefill]
        assert all(e.held_kv_bytes == pytest.approx(0.0, abs=1.0) for e in pes)
        peak = max(e.peak_held_kv_bytes for e in pes)
        if gated:
            assert room - largest < peak <= room  # the limit was reached, never passed
        else:
            assert peak == 0.0
