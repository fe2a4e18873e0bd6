"""Fig. 11's TPOT claims: DualPath vs Basic (no extra decode overhead) and, for DS 27B, Basic
and DualPath vs Oracle (well above), compared at the arrival rates the modes share."""

from __future__ import annotations

import math

from dualpath.plan.capacity import OnlinePoint
from dualpath.reproduce.online import tpot_claims


def _pts(tpot_by_aps: dict[float, float]) -> list[OnlinePoint]:
    return [OnlinePoint(aps, 1.0, 0.1, tpot, 100.0, {}, "steady_state", 900.0)
            for aps, tpot in tpot_by_aps.items()]


def test_alike_decoding_passes_the_overhead_claim_and_fails_well_above() -> None:
    pts = {"basic": _pts({0.3: 0.0152, 0.6: 0.0170}), "dualpath": _pts({0.3: 0.0154}),
           "oracle": _pts({0.3: 0.0151, 0.9: 0.0195})}
    vs_basic, vs_oracle = tpot_claims("ds27b_1p1d", pts)
    assert vs_basic.is_pass and "1.01x at 0.300 APS (farthest of 1)" in vs_basic.ours
    assert not vs_oracle.is_pass and vs_oracle.cause
    assert vs_oracle.ours == "Basic 1.01x, DualPath 1.02x at 0.300 APS (lowest of 1)"


def test_each_claim_fails_or_passes_on_its_own_rule() -> None:
    pts = {"basic": _pts({0.3: 0.020, 0.45: 0.022}), "dualpath": _pts({0.3: 0.023, 0.45: 0.022}),
           "oracle": _pts({0.3: 0.016, 0.45: 0.019})}
    vs_basic, vs_oracle = tpot_claims("ds27b_1p1d", pts)
    assert not vs_basic.is_pass  # 1.15x at 0.3 APS: more than 5% above Basic
    assert "1.15x at 0.300" in vs_basic.ours
    assert vs_oracle.is_pass  # 1.25x and 1.16x, 1.44x and 1.16x of Oracle


def test_only_ds27b_has_the_oracle_claim_and_unshared_rates_give_none() -> None:
    pts = {"basic": _pts({0.3: 0.036}), "dualpath": _pts({0.3: 0.036}),
           "oracle": _pts({0.3: 0.036})}
    assert len(tpot_claims("ds660b_2p4d", pts)) == 1
    apart = {"basic": _pts({0.2: 0.015}), "dualpath": _pts({0.3: 0.015}),
             "oracle": _pts({0.3: 0.015, 0.2: math.nan})}
    assert tpot_claims("ds27b_1p1d", apart) == []


def test_a_mode_that_fell_behind_is_not_compared() -> None:
    # Basic never steady at 0.3 APS (its queue grew): only 0.15, where both kept up, counts.
    basic = [OnlinePoint(0.15, 1.0, 0.1, 0.0150, 100.0, {}, "steady_state", 900.0),
             OnlinePoint(0.3, 9.0, 0.1, 0.0140, 100.0, {}, "max_duration", math.nan)]
    dual = _pts({0.15: 0.0151, 0.3: 0.0170})
    (vs_basic,) = tpot_claims("ds660b_2p4d", {"basic": basic, "dualpath": dual})
    assert vs_basic.is_pass and "at 0.150 APS (farthest of 1)" in vs_basic.ours
    # Too short to judge: within the SLO counts, past it does not.
    short = [OnlinePoint(0.3, 1.0, 0.1, 0.015, 100.0, {}, "max_duration"),
             OnlinePoint(2.4, 4.4, 0.1, 0.015, 100.0, {}, "max_duration")]
    (vs_basic,) = tpot_claims("ds660b_2p4d", {"basic": short,
                                              "dualpath": _pts({0.3: 0.015, 2.4: 0.0165})})
    assert vs_basic.is_pass and "farthest of 1" in vs_basic.ours
