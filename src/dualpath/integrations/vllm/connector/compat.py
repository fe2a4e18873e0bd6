"""What differs between the vLLM releases the connector runs on, detected in one place.

The connector is written against vLLM 0.32's API. Where another release differs in what the
connector overrides, calls or reads, this module detects the feature (never the version
number) and gives the connector one answer (`docs/vllm/gpu.md` says which releases run where;
`tools/vllm_api.py` checks the signatures of each release statically):

- `CacheHitSource` (vLLM >= 0.32): the label of a connector's external hits, which the base
  class reads from `_cache_hit_source`. Before, hits have no label: nothing to set.
- KV cache layout names: from vLLM 0.30 (`vllm.v1.kv_cache_layout`) a layout names every
  dimension (LBHNC: layer, block, heads, tokens, content); before, only a page's order (HND).
  Both give the page order the connector needs: each block's page of a layer is one dense run
  in logical [H, N, C] order.
- `KVCacheConfig.kv_cache_layout` (vLLM >= 0.30): the layout vLLM allocated. Before, vLLM
  allocated the one the connector required (`pages.paged_kv_bases` refuses any other).
- `CachedRequestData.resumed_req_ids` (vLLM <= 0.33): a request resumed after preemption
  comes among the cached ones, flagged there. From 0.34 it is re-sent in full among the new
  ones (its blocks and worker state were dropped at preemption).

Like `dualpath_connector`, this module imports vllm.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    DISK_HIT_SOURCE: Any = CacheHitSource.DISK
    """The connector's hits come from storage."""
except ImportError:
    DISK_HIT_SOURCE = None

try:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    HEADS_FIRST_LAYOUT: str = KVCacheLayout.LBHNC.name
    """The KV cache layout the connector requires, in this release's names."""
except ImportError:
    HEADS_FIRST_LAYOUT = "HND"


def kv_cache_layout(kv_cache_config: Any) -> str | None:
    """The KV cache layout vLLM allocated (part of the store's key namespace)."""
    return getattr(kv_cache_config, "kv_cache_layout", HEADS_FIRST_LAYOUT)  # type: ignore[no-any-return]


def resumed_req_ids(cached_reqs: Any) -> Collection[str]:
    """The ids among a step's cached requests that resume after a preemption (none where vLLM
    re-sends a resumed request among the new ones)."""
    return getattr(cached_reqs, "resumed_req_ids", None) or frozenset()  # type: ignore[no-any-return]
