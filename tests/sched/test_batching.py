"""Intra-engine FIFO packing under a compute quota with chunked prefill."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.core.hardware import hardware_preset
from dualpath.core.model import model_preset
from dualpath.sched.batching import PrefillItem, pack_prefill_batch
from dualpath.sched.cost import CostModelEstimator, batch_attention_time_s, coefficients_for


@dataclass(frozen=True)
class Quadratic:
    """Hand-checkable estimator: 10 ms fixed + 1 us per new token per (cached + new) key."""

    def fixed_time_s(self) -> float:
        return 0.010

    def pair_time_s(self, cached_tokens: int, new_tokens: int) -> float:
        return 1e-6 * new_tokens * (cached_tokens + new_tokens)


def test_whole_requests_then_largest_fitting_chunk() -> None:
    est = Quadratic()
    queue = [PrefillItem(0, 0, 100), PrefillItem(1, 100, 100), PrefillItem(2, 0, 1000),
             PrefillItem(3, 0, 10)]
    b = pack_prefill_batch(queue, 0.100, est)
    # r0: 1e-6*100*100 = 0.010 -> 0.020; r1: 1e-6*100*200 = 0.020 -> 0.040.
    # r2 whole: 1e-6*1000*1000 = 1.0 > 0.060 left: largest b with b*b*1e-6 <= 0.060 is 244.
    assert [(e.request_id, e.num_new_tokens, e.is_chunk) for e in b.entries] == [
        (0, 100, False), (1, 100, False), (2, 244, True)]
    assert b.estimated_attention_s <= 0.100
    assert est.pair_time_s(0, 245) > 0.100 - 0.040  # 245 does not fit: 244 is the largest
    assert abs(b.estimated_attention_s - batch_attention_time_s(est, b.pairs)) < 1e-12


def test_everything_fits_in_fifo_order() -> None:
    queue = [PrefillItem(i, 10, 10) for i in range(5)]
    b = pack_prefill_batch(queue, 0.3, Quadratic())
    assert [e.request_id for e in b.entries] == [0, 1, 2, 3, 4]
    assert not any(e.is_chunk for e in b.entries)


def test_head_always_makes_progress() -> None:
    # The fixed time alone exceeds the quota: the head still runs one token.
    b = pack_prefill_batch([PrefillItem(0, 0, 50), PrefillItem(1, 0, 5)], 0.005, Quadratic())
    assert [(e.request_id, e.num_new_tokens, e.is_chunk) for e in b.entries] == [(0, 1, True)]


def test_token_cap_chunks_too() -> None:
    queue = [PrefillItem(0, 0, 30), PrefillItem(1, 0, 30)]
    b = pack_prefill_batch(queue, 10.0, Quadratic(), max_batch_tokens=40)
    assert [(e.num_new_tokens, e.is_chunk) for e in b.entries] == [(30, False), (10, True)]


def test_cost_model_estimator_packs_a_real_model() -> None:
    model, hw = model_preset("deepseek-v3.2"), hardware_preset("h800-deepseek")
    est = CostModelEstimator(model, hw, coefficients_for(model, hw))
    queue = [PrefillItem(i, 32_000, 429) for i in range(50)]
    b = pack_prefill_batch(queue, 0.3, est)
    assert 1 <= len(b.entries) < 50
    assert b.estimated_attention_s <= 0.3
    # One more token of the last request would break the quota.
    last = b.entries[-1]
    grown = (*b.pairs[:-1], (last.cached_tokens, last.num_new_tokens + 1))
    assert batch_attention_time_s(est, grown) > 0.3
