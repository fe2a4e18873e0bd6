"""SimParams.decode_slot_hold_s: a turn's decode seat (under the sequence cap), HBM and load
stay on its DE until max(its last token, its DE assignment + the hold); 0 changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
from sim_cases import run_offline, tiny_cluster, trajectories

from dualpath.core.errors import SpecError
from dualpath.sched.params import derive_scheduler_params
from dualpath.sim import SimParams, SimResult

CL = tiny_cluster()
CAP1 = derive_scheduler_params(CL.model, CL.hardware, max_seqs_per_decode_engine=1)


def _run(hold: float | None, num_agents: int) -> SimResult:
    # Single-turn agents, twice as many as the DEs could seat at once under a cap of 1 each
    # when num_agents = 2 x engines: the second wave waits for the first's seats.
    wl = trajectories(num_agents=num_agents, num_turns=1, append=0, gen=32, first=2048)
    params = SimParams() if hold is None else SimParams(decode_slot_hold_s=hold)
    return run_offline(CL, wl, "oracle", params=params, scheduler=CAP1)


def _num_des() -> int:
    return len(set(_run(None, 64).col("de_engine").tolist()))


def test_capped_engine_admits_next_turn_only_after_the_hold() -> None:
    n = _num_des()
    base = _run(None, 2 * n)
    held = _run(5.0, 2 * n)
    assert base.num_completed == held.num_completed == 2 * n
    for res in (base, held):
        # One wave at t = 0 on every DE, one after: each engine holds two turns, in turn.
        assert np.bincount(res.col("de_engine").astype(np.int64)).max() == 2
    decode_s = float((base.col("done_s") - base.col("de_assigned_s")).max())
    assert decode_s < 1.0  # so a 5 s hold outlasts every turn's own decode
    for res, hold in ((base, 0.0), (held, 5.0)):
        eng, assigned, done = res.col("de_engine"), res.col("de_assigned_s"), res.col("done_s")
        for e in set(eng.tolist()):
            first, second = np.argsort(assigned[eng == e])
            a, d = assigned[eng == e], done[eng == e]
            assert a[first] == 0.0
            # The engine at its cap takes the next turn when its seat comes back: at the first
            # turn's last token without a hold, at assignment + hold with one.
            assert a[second] == pytest.approx(max(d[first], a[first] + hold), abs=1e-9)
    # The second wave starts at 5 s, after the whole run without a hold had ended.
    assert base.jct_s < 5.0 < held.jct_s


def test_zero_hold_is_the_default() -> None:
    wl = trajectories(num_agents=6, num_turns=3, append=512, gen=16, first=2048)
    for mode in ("oracle", "dualpath", "basic"):
        a = run_offline(CL, wl, mode, scheduler=CAP1)
        b = run_offline(CL, wl, mode, params=SimParams(decode_slot_hold_s=0.0), scheduler=CAP1)
        assert a.jct_s == b.jct_s
        for name in ("de_engine", "de_assigned_s", "prefill_done_s", "done_s"):
            assert np.array_equal(a.col(name), b.col(name))


def test_hold_shorter_than_the_decode_changes_nothing() -> None:
    wl = trajectories(num_agents=6, num_turns=3, append=512, gen=16, first=2048)
    a = run_offline(CL, wl, "oracle", scheduler=CAP1)
    b = run_offline(CL, wl, "oracle", params=SimParams(decode_slot_hold_s=1e-6),
                    scheduler=CAP1)
    assert np.array_equal(a.col("done_s"), b.col("done_s"))


def test_negative_hold_is_refused() -> None:
    with pytest.raises(SpecError, match="decode_slot_hold_s"):
        SimParams(decode_slot_hold_s=-1.0)
