"""ProfiledCosts: the measured step-cost model the simulator charges with a profile."""

from __future__ import annotations

import pickle
from itertools import pairwise

import pytest

from dualpath.core.errors import SpecError
from dualpath.sched.batching import largest_fitting_bsz
from dualpath.sched.cost import batch_attention_time_s
from dualpath.sched.profiled import ProfiledCosts

COSTS = ProfiledCosts(1e-3, 2e-4, 1e-5, 1e-8, 1e-7, 5e-4, 1e-4, 1e-8)


def test_pair_time_is_zero_without_new_tokens_and_grows_with_them() -> None:
    assert COSTS.pair_time_s(500, 0) == 0.0
    times = [COSTS.pair_time_s(500, b) for b in range(1, 200)]
    assert all(b > a for a, b in pairwise(times))
    assert COSTS.pair_time_s(1000, 64) > COSTS.pair_time_s(0, 64)


def test_pass_time_is_the_estimators_batch_time() -> None:
    pairs = [(0, 64), (512, 16), (128, 0)]
    assert COSTS.prefill_pass_time_s(pairs) == pytest.approx(
        batch_attention_time_s(COSTS, pairs))
    want = 1e-3 + (2e-4 + 64 * (1e-5 + 1e-8 * 64)) + (2e-4 + 16 * (1e-5 + 1e-8 * 528)
                                                      + 512 * 1e-7)
    assert COSTS.prefill_pass_time_s(pairs) == pytest.approx(want)


def test_decode_step_time() -> None:
    assert COSTS.decode_step_time_s(0, 0) == 0.0
    assert COSTS.decode_step_time_s(4, 1000) == pytest.approx(5e-4 + 4e-4 + 1e-5)


def test_packing_binary_search_on_it() -> None:
    budget = COSTS.pair_time_s(0, 100)
    assert largest_fitting_bsz(COSTS, 0, 1000, budget) == 100


def test_negative_coefficient_is_refused_by_name() -> None:
    with pytest.raises(SpecError, match="per_seq_s"):
        ProfiledCosts(0, 0, 0, 0, 0, 0, -1.0, 0)


def test_pickles_by_constructor() -> None:
    assert pickle.loads(pickle.dumps(COSTS)) == COSTS
