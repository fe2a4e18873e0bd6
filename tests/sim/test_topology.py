"""The simulated cluster a config describes: topology, HBM room, expert-parallel groups."""

from __future__ import annotations

import io
from collections import Counter

import pytest
from sim_cases import IO_BOUND, run_offline, tiny_cluster, trajectories

from dualpath.core.cluster import ClusterSpec
from dualpath.core.hardware import hardware_preset
from dualpath.core.model import model_preset
from dualpath.core.units import GB
from dualpath.sim import SimConfig, SimParams, SimResult
from dualpath.sim.topology import Cluster


def test_a_turn_no_decode_engine_can_hold_is_refused_up_front() -> None:
    from dualpath.core.errors import SpecError

    cl = ClusterSpec(hardware_preset("h800-deepseek").with_overrides(hbm_bytes=40 * GB),
                     model_preset("qwen2.5-32b"), 1, 1)
    # Qwen KV is 256 KiB/token: 40 GB x 0.9 - 33 GB of weights leaves room for ~11k tokens.
    wl = trajectories(num_agents=1, num_turns=1, append=64, gen=4, first=20_000)
    with pytest.raises(SpecError, match="decode-engine HBM"):
        run_offline(cl, wl, "dualpath")
    small = trajectories(num_agents=1, num_turns=2, append=64, gen=4, first=2_000)
    r = run_offline(cl, small, "dualpath")
    assert r.stop_reason == "completed" and r.num_completed == small.num_turns


def test_expert_parallel_groups_set_the_weight_shard_each_decode_step_reads() -> None:
    cluster = tiny_cluster(1, 2)  # ds-27b is MoE; 16 decode engines
    assert cluster.model.is_moe and cluster.num_decode_engines == 16
    wl = trajectories(4, 2, append=200, gen=16, first=2000)

    def run(decode_ep: int) -> SimResult:
        return run_offline(cluster, wl, "dualpath", params=SimParams(decode_ep_engines=decode_ep))

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
    cluster = tiny_cluster(1, 1)
    wl = trajectories(96, 2, append=200, gen=2000, first=30000)

    def csv(r: SimResult) -> str:
        out = io.StringIO()
        r.write_csv(out)
        return out.getvalue()

    default = run_offline(cluster, wl, "oracle")
    assert csv(default) == csv(run_offline(cluster, wl, "oracle",
                                    params=SimParams(hbm_reserve_fraction=0.1)))
    by_coeff = run_offline(cluster, wl, "oracle", cost_overrides=(("hbm_reserve_fraction", 0.9),))
    by_param = run_offline(cluster, wl, "oracle", params=SimParams(hbm_reserve_fraction=0.9))
    assert csv(by_coeff) == csv(by_param)
    # The params win over the coefficients.
    both = run_offline(cluster, wl, "oracle", cost_overrides=(("hbm_reserve_fraction", 0.9),),
                params=SimParams(hbm_reserve_fraction=0.1))
    assert csv(both) == csv(default)
    # Fewer sequences per decode engine: turns wait for HBM, and the run takes longer.
    assert by_coeff.jct_s > 1.5 * default.jct_s
    from dualpath.core.errors import SpecError

    with pytest.raises(SpecError, match="hbm_reserve_fraction"):
        SimParams(hbm_reserve_fraction=1.0)


@pytest.mark.parametrize("is_sync", [True, False])
def test_nodes_engines_links_and_groups_follow_the_cluster_spec(is_sync: bool) -> None:
    spec = tiny_cluster(1, 2)  # one prefill node, two decode nodes, 8 engines each
    g = spec.hardware.gpus_per_node
    cfg = SimConfig(spec, IO_BOUND, params=SimParams(is_group_synchronized=is_sync,
                                                     storage_cluster_bytes_per_s=1e12))
    cl = Cluster(cfg)
    assert [n.is_prefill for n in cl.nodes] == [True, False, False]
    assert [(e.idx, e.node) for e in cl.engines] == [(e, e // g) for e in range(3 * g)]
    assert Counter(link.kind for link in cl.links) == {
        "storage": 1, "snic_read": 3, "snic_write": 3, "pe_dram": 1, "de_dram": 2,
        "pe_cnic_read": g, "pe_cnic_write": g, "de_cnic_read": 2 * g, "de_cnic_write": 2 * g,
    }
    assert cl.storage_link is cl.links[0]
    rooms = {e.free_hbm_bytes for e in cl.engines[:g]}, {e.free_hbm_bytes for e in cl.engines[g:]}
    assert rooms == ({cl.pe_hbm_kv_bytes}, {cl.de_hbm_kv_bytes})
    if is_sync:  # a group per node
        assert [grp.engines for grp in cl.pgroups] == [list(range(g))]
        assert [grp.engines for grp in cl.dgroups] == [list(range(g, 2 * g)),
                                                       list(range(2 * g, 3 * g))]
    else:  # a group per engine
        assert [grp.engines for grp in cl.pgroups] == [[e] for e in range(g)]
        assert [grp.engines for grp in cl.dgroups] == [[e] for e in range(g, 3 * g)]
    for e in range(g, 3 * g):
        assert cl.dgroups[cl.dgroup_index[e]] is cl.dgroup_of[e]
        assert e in cl.dgroup_of[e].engines
    assert all(e in cl.pgroup_of[e].engines for e in range(g))
    assert list(cl.de_nodes) == [1, 2]


def test_a_dense_70b_fits_tensor_parallel_engines_and_their_nics_follow_them() -> None:
    from dualpath.core.errors import SpecError
    from dualpath.core.model import dense_gqa_spec

    llama = dense_gqa_spec("llama-70b", hidden=8192, num_layers=80, num_heads=64,
                           num_kv_heads=8, head_dim=128, intermediate=28672, vocab_size=128256,
                           kv_dtype_bytes=2, weight_dtype_bytes=2)
    h200 = hardware_preset("h200")
    wl = trajectories(num_agents=4, num_turns=2, append=256, gen=8, first=8192)
    # One GPU cannot hold 141 GB of BF16 weights and any KV: the error says what would help.
    with pytest.raises(SpecError, match=r"larger engines \(--tensor-parallel-size\)"):
        run_offline(ClusterSpec(h200, llama, 1, 2), wl, "dualpath")
    spec = ClusterSpec(h200, llama, 1, 2, tensor_parallel_size=8)
    assert (spec.num_prefill_engines, spec.num_decode_engines, spec.num_gpus) == (1, 2, 24)
    cl = Cluster(SimConfig(spec, wl))
    assert [n.engines for n in cl.nodes] == [[0], [1], [2]]
    # One engine per node, with all eight GPUs' compute NICs and HBM.
    assert cl.cnic_bytes_per_s == 8 * min(h200.compute_nic_bytes_per_s, h200.pcie_bytes_per_s)
    assert cl.de_hbm_kv_bytes == pytest.approx(8 * h200.hbm_bytes * 0.9 - llama.weight_bytes)
    r = run_offline(spec, wl, "dualpath")
    assert r.stop_reason == "completed" and r.num_completed == wl.num_turns
    assert r.cluster == "1P2D TP8"
