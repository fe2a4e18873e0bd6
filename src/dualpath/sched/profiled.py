"""Step costs measured on a real engine (`dualpath profile`), as plain numbers: the cost model
the simulator charges in place of the roofline one (`sched.cost`) when a run is given a profile.

Pure data and arithmetic (no file format, no clock): `dualpath.plan.step_profile` reads and
fits the profile file and hands the fitted coefficients here.

Shape (every coefficient >= 0, so times are non-decreasing in every argument):

- prefill, one forward pass of one engine over `(cached, new)` pairs:
  `prefill_fixed_s + sum over pairs with new > 0 of [per_prefill_seq_s + new * per_new_token_s
  + new * (cached + new) * per_query_key_s + cached * per_cached_token_s]`
  (per sequence: its layer calls; linear layers per new token; attention per query-key pair;
  the cached KV each pass loads into the attention per cached token). It is the whole pass:
  a measured engine has no separate FFN phase to charge.
- decode, one step of one engine:
  `decode_fixed_s + batch * per_seq_s + context * per_context_token_s`
  (`context`: tokens held by all its sequences together).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dualpath.core.pickling import pickle_by_fields
from dualpath.core.validate import non_negative


@dataclass(frozen=True)
class ProfiledCosts:
    """Fitted step costs of one engine (seconds). Also an `AttentionTimeEstimator`, so intra-
    engine packing budgets the same times the simulator charges."""

    prefill_fixed_s: float
    per_prefill_seq_s: float
    per_new_token_s: float
    per_query_key_s: float
    per_cached_token_s: float
    decode_fixed_s: float
    per_seq_s: float
    per_context_token_s: float
    source: str = ""
    """Where the numbers come from (the profile file, engine, machine)."""

    def __post_init__(self) -> None:
        for name in ("prefill_fixed_s", "per_prefill_seq_s", "per_new_token_s", "per_query_key_s",
                     "per_cached_token_s", "decode_fixed_s", "per_seq_s",
                     "per_context_token_s"):
            non_negative("profiled_costs", name, getattr(self, name))

    # -- AttentionTimeEstimator ----------------------------------------------------------------
    def fixed_time_s(self) -> float:
        return self.prefill_fixed_s

    def pair_time_s(self, cached_tokens: int, new_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        return (self.per_prefill_seq_s
                + new_tokens * (self.per_new_token_s
                                + self.per_query_key_s * (cached_tokens + new_tokens))
                + cached_tokens * self.per_cached_token_s)

    # -- what the simulator charges --------------------------------------------------------------
    def prefill_pass_time_s(self, pairs: Iterable[tuple[float, float]]) -> float:
        """One whole forward pass of one engine over `(cached, new)` pairs."""
        total = self.prefill_fixed_s
        for cached, new in pairs:
            if new > 0:
                total += (self.per_prefill_seq_s
                          + new * (self.per_new_token_s + self.per_query_key_s * (cached + new))
                          + cached * self.per_cached_token_s)
        return total

    def decode_step_time_s(self, batch_size: int, total_context_tokens: float) -> float:
        """One decode step of `batch_size` sequences holding `total_context_tokens` in all."""
        if batch_size <= 0:
            return 0.0
        return (self.decode_fixed_s + batch_size * self.per_seq_s
                + total_context_tokens * self.per_context_token_s)


# Compiled (mypyc) frozen dataclasses unpickle only by constructor.
pickle_by_fields(ProfiledCosts)
