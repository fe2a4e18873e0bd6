"""Intra-engine (PE) scheduling: FIFO packing under a compute quota, with chunked prefill
(paper §6.2). DEs need none: they put every request into each decode batch.

Each request in a batch is a pair (cached, bsz): `cached` tokens whose KV is available (storage
hit or earlier chunks), `bsz` tokens to compute now. Requests join in FIFO order while the
estimated attention-layer time stays within the quota (default 300 ms, paper A.4), so all GPUs
of a data-parallel attention group reach the FFN sync together. The first request that does not
fit whole is chunked to the largest `bsz'` that fits (binary search) and packing stops there
(the paper does not say whether packing continues past it; stopping keeps FIFO order).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from dualpath.core.errors import SpecError
from dualpath.core.pickling import pickle_by_fields
from dualpath.core.validate import positive
from dualpath.sched.cost import AttentionTimeEstimator

_INF: Final = float("inf")


# Written `__init__`s, not `frozen=True`: built on every pack (see `dualpath.sched.types`).
@dataclass(slots=True, init=False, unsafe_hash=True)
class PrefillItem:
    """A request in a PE's local queue: `remaining_tokens` still to prefill after
    `cached_tokens` whose KV is available."""

    request_id: int
    cached_tokens: int
    remaining_tokens: int

    def __init__(self, request_id: int, cached_tokens: int, remaining_tokens: int) -> None:
        self.request_id = request_id
        self.cached_tokens = cached_tokens
        self.remaining_tokens = remaining_tokens
        self.__post_init__()

    def __post_init__(self) -> None:
        # The owner's name is built only for an error (an item per pack: a hot path).
        if self.cached_tokens < 0:
            raise SpecError(f"prefill_item[{self.request_id}]", "cached_tokens",
                            self.cached_tokens, "must be >= 0")
        if self.remaining_tokens < 1:
            raise SpecError(f"prefill_item[{self.request_id}]", "remaining_tokens",
                            self.remaining_tokens, "must be >= 1")


@dataclass(slots=True, init=False, unsafe_hash=True)
class BatchEntry:
    """One request's share of a forward batch: `num_new_tokens` after `cached_tokens`."""

    request_id: int
    cached_tokens: int
    num_new_tokens: int
    is_chunk: bool
    """Only part of the request's remaining tokens: it stays at the queue head with
    `cached_tokens + num_new_tokens` cached."""

    def __init__(self, request_id: int, cached_tokens: int, num_new_tokens: int,
                 is_chunk: bool) -> None:
        self.request_id = request_id
        self.cached_tokens = cached_tokens
        self.num_new_tokens = num_new_tokens
        self.is_chunk = is_chunk

@dataclass(slots=True, init=False, unsafe_hash=True)
class PrefillBatch:
    """A forward batch. Invariant: a FIFO prefix of the queue, only the last entry may be a
    chunk, and `estimated_attention_s <= quota` unless the batch is the head request's
    minimum one-token progress (see `pack_prefill_batch`)."""

    entries: tuple[BatchEntry, ...]
    estimated_attention_s: float

    def __init__(self, entries: tuple[BatchEntry, ...], estimated_attention_s: float) -> None:
        self.entries = entries
        self.estimated_attention_s = estimated_attention_s

    @property
    def num_new_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.entries)

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        """The (cached, bsz) pairs, as the cost model takes them."""
        return tuple((e.cached_tokens, e.num_new_tokens) for e in self.entries)


def largest_fitting_bsz(
    estimator: AttentionTimeEstimator, cached_tokens: int, max_bsz: int, budget_s: float
) -> int:
    """Largest `b` in `[0, max_bsz]` with `pair_time_s(cached, b) <= budget_s` (binary search,
    relying on `pair_time_s` being non-decreasing in `b`)."""
    lo, hi = 0, max_bsz  # invariant: lo fits (pair time of 0 is 0 <= any budget >= 0)
    if budget_s < 0:
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimator.pair_time_s(cached_tokens, mid) <= budget_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def pack_prefill_batch(
    queue: Iterable[PrefillItem],
    quota_s: float,
    estimator: AttentionTimeEstimator,
    *,
    max_batch_tokens: int | None = None,
) -> PrefillBatch:
    """Pack one forward batch from a PE's FIFO `queue` (head first) under `quota_s` seconds of
    estimated attention time; `max_batch_tokens` optionally caps the new tokens too.

    Invariants: entries are a FIFO prefix of `queue`; every entry but the last is whole; the
    estimate never exceeds the quota, except that a non-empty queue always yields a non-empty
    batch: if not even one token of the head fits, the head runs one token (progress beats the
    quota; only a quota below the fixed per-pass time or a gigantic context causes this).
    Cost: O(batch + log bsz) estimator calls.
    """
    if not 0.0 < quota_s < _INF:  # the full check (and its message) off the hot path
        positive("pack", "quota_s", quota_s)
    if max_batch_tokens is not None and max_batch_tokens < 1:
        raise SpecError("pack", "max_batch_tokens", max_batch_tokens, "must be >= 1")
    token_room = max_batch_tokens if max_batch_tokens is not None else None
    t = estimator.fixed_time_s()
    entries: list[BatchEntry] = []
    for item in queue:
        want = item.remaining_tokens
        if token_room is not None:
            want = min(want, token_room)
        dt = estimator.pair_time_s(item.cached_tokens, want)
        if t + dt <= quota_s and want == item.remaining_tokens:
            entries.append(BatchEntry(item.request_id, item.cached_tokens, want, False))
            t += dt
            if token_room is not None:
                token_room -= want
                if token_room == 0:
                    break
            continue
        bsz = largest_fitting_bsz(estimator, item.cached_tokens, want, quota_s - t)
        if bsz == 0 and not entries:
            bsz = 1
        if bsz > 0:
            entries.append(BatchEntry(item.request_id, item.cached_tokens, bsz,
                                      bsz < item.remaining_tokens))
            t += estimator.pair_time_s(item.cached_tokens, bsz)
        break
    return PrefillBatch(tuple(entries), t if entries else 0.0)  # no batch, no forward pass


# Compiled (mypyc) frozen dataclasses unpickle only by constructor (runtime messages).
pickle_by_fields(PrefillItem, BatchEntry, PrefillBatch)
