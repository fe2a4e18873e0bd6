"""The PE pass-time estimator: the fit recovers known coefficients, never goes negative, and
packing under it chunks a pass that would overrun the quota."""

from __future__ import annotations

import pytest

from dualpath.core.errors import SpecError
from dualpath.runtime.estimator import MeasuredEstimator, cost_model_estimator, fit, make_estimator
from dualpath.runtime.model.weights import tiny_random_model
from dualpath.sched.batching import PrefillItem, pack_prefill_batch


def test_fit_recovers_known_coefficients() -> None:
    truth = MeasuredEstimator(fixed_s=0.002, per_token_s=4e-5, per_pair_s=1e-7)
    samples = [(b, truth.fixed_time_s() + truth.pair_time_s(0, b)) for b in (32, 128, 512, 1024)]
    got = fit(samples)
    assert got.fixed_s == pytest.approx(0.002, rel=1e-6)
    assert got.per_token_s == pytest.approx(4e-5, rel=1e-6)
    assert got.per_pair_s == pytest.approx(1e-7, rel=1e-6)


def test_fit_drops_a_negative_coefficient() -> None:
    # Times that fall with size would need a negative quadratic term: it is dropped.
    got = fit([(32, 0.010), (128, 0.030), (512, 0.040)])
    assert min(got.fixed_s, got.per_token_s, got.per_pair_s) >= 0
    assert got.pair_time_s(100, 0) == 0
    assert got.pair_time_s(100, 50) <= got.pair_time_s(100, 51)
    with pytest.raises(SpecError, match="at least 3"):
        fit([(1, 0.1), (2, 0.2)])


def test_packing_chunks_what_the_measured_estimate_puts_over_the_quota() -> None:
    model = tiny_random_model(0)
    est = make_estimator("measured", model)
    assert isinstance(est, MeasuredEstimator) and est.pair_time_s(0, 512) > 0
    # The fixed per-pass time plus half the token-dependent time of a 2000-token pass. (Half
    # the whole pass could be below the fixed time, as on a GPU, where a pass of any size
    # overruns such a quota and the packer rightly returns the smallest chunk.)
    quota = est.fixed_time_s() + est.pair_time_s(0, 2000) / 2
    batch = pack_prefill_batch([PrefillItem(1, 0, 2000), PrefillItem(2, 0, 10)], quota, est)
    (entry,) = batch.entries
    assert entry.is_chunk and 0 < entry.num_new_tokens < 2000
    assert batch.estimated_attention_s <= quota
    assert cost_model_estimator(model).pair_time_s(0, 64) > 0
    with pytest.raises(SpecError, match="estimator"):
        make_estimator("guess", model)
