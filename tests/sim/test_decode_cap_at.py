"""SimParams.decode_cap_at: the decode sequence cap holds a turn back at its DE assignment
(`assign`, before its prefill) or at decode admission (`decode`, after its prefill)."""

from __future__ import annotations

import numpy as np
import pytest
from sim_cases import run_offline, tiny_cluster, trajectories

from dualpath.core.errors import SpecError
from dualpath.sched.params import derive_scheduler_params
from dualpath.sim import SimParams, SimResult

CL = tiny_cluster()
CAP1 = derive_scheduler_params(CL.model, CL.hardware, max_seqs_per_decode_engine=1)


def _run(at: str, num_agents: int, mode: str = "oracle") -> SimResult:
    # Single-turn agents, twice as many as the DEs seat under a cap of 1 each.
    wl = trajectories(num_agents=num_agents, num_turns=1, append=0, gen=32, first=2048)
    return run_offline(CL, wl, mode, params=SimParams(decode_cap_at=at), scheduler=CAP1)


@pytest.mark.parametrize("mode", ["oracle", "dualpath"])
def test_cap_at_decode_lets_the_second_wave_prefill_early(mode: str) -> None:
    n = len(set(_run("assign", 64).col("de_engine").tolist()))
    runs = {at: _run(at, 2 * n, mode) for at in ("assign", "decode")}
    for at, res in runs.items():
        assert res.num_completed == 2 * n
        eng = res.col("de_engine")
        assigned, prefilled, done = (res.col(c) for c in ("de_assigned_s", "prefill_done_s",
                                                          "done_s"))
        for e in set(eng.tolist()):
            a, p, d = assigned[eng == e], prefilled[eng == e], done[eng == e]
            assert len(a) == 2  # each engine takes two turns, one after the other
            first, second = np.argsort(d)
            if at == "assign":
                # The capped engine is not given its second turn until the first has ended:
                # its read and prefill come after that.
                assert a[second] == pytest.approx(d[first], abs=1e-9)
                assert p[second] > d[first]
            else:
                # Both given at once (HBM only); the second prefills meanwhile and waits.
                assert a[second] == 0.0
                assert p[second] < d[first] < d[second]
    assert runs["decode"].jct_s < runs["assign"].jct_s


def test_without_a_cap_the_two_agree() -> None:
    wl = trajectories(num_agents=6, num_turns=3, append=512, gen=16, first=2048)
    for mode in ("oracle", "dualpath", "basic"):
        a = run_offline(CL, wl, mode, params=SimParams(decode_cap_at="assign"))
        b = run_offline(CL, wl, mode, params=SimParams(decode_cap_at="decode"))
        for name in ("de_engine", "de_assigned_s", "prefill_done_s", "done_s"):
            assert np.array_equal(a.col(name), b.col(name))


def test_unknown_place_is_refused() -> None:
    with pytest.raises(SpecError, match="decode_cap_at"):
        SimParams(decode_cap_at="prefill")
