"""A vLLM request's key scope: what its KV depends on besides the model and its token ids,
read from what vLLM has already computed for the request (`Request.cache_salt`, its
`lora_request`, its multimodal features' hashes), never re-derived.

A request is keyed only when every extra key vLLM's own block hash would add for it is one
the scope covers; anything else (prompt embeddings, a multimodal input vLLM did not hash, an
extra key a newer vLLM adds) makes it unkeyable: it is served, but neither loaded from nor
saved to the store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from dualpath.core.blocks import KeyScope, MediaSpan

log = logging.getLogger(__name__)

COVERED_EXTRA_KEYS = frozenset({"lora", "mm", "cache_salt"})
"""The tags of vLLM's block-hash extra keys that `KeyScope` covers."""


def _vllm_extra_keys() -> Callable[..., Any] | None:
    """vLLM's `generate_block_hash_extra_keys`, where this vLLM has it."""
    try:
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
    except ImportError:
        return None
    return generate_block_hash_extra_keys  # type: ignore[no-any-return]


def request_scope(request: Any, block_size: int) -> tuple[KeyScope | None, str]:
    """The request's `KeyScope`, or None and why it cannot be keyed safely."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None, "prompt embeddings"
    media: list[MediaSpan] = []
    for feature in getattr(request, "mm_features", None) or ():
        identifier = getattr(feature, "identifier", None)
        position = getattr(feature, "mm_position", None)
        if not identifier or position is None:
            return None, "a multimodal input without vLLM's hash"
        media.append(MediaSpan(str(identifier), int(position.offset), int(position.length)))
    lora = getattr(request, "lora_request", None)
    adapter = (str(lora.lora_name), str(lora.lora_path)) if lora is not None else None
    salt = getattr(request, "cache_salt", None) or None
    uncovered = _uncovered_extra_keys(request, block_size, media)
    if uncovered:
        return None, f"vLLM hashes its blocks with {', '.join(sorted(uncovered))}"
    return KeyScope(cache_salt=salt, adapter=adapter, media=tuple(media)), ""


def _uncovered_extra_keys(request: Any, block_size: int, media: list[MediaSpan]) -> set[str]:
    """The tags of the extra keys vLLM's block hash adds to the request's first block and to
    each block holding a multimodal input that the scope does not cover."""
    extra_keys = _vllm_extra_keys()
    if extra_keys is None:
        return set()
    starts = {0} | {m.offset // block_size * block_size for m in media}
    tags: set[str] = set()
    for start in sorted(starts):
        try:
            keys, _ = extra_keys(request, start, start + block_size, 0)
        except Exception as e:  # an API this module does not know: do not guess
            log.warning("DualPathConnector: cannot read vLLM's block-hash extra keys (%s)", e)
            return {"unknown extra keys"}
        for key in keys or ():
            tag = key[0] if isinstance(key, tuple) and key else type(key).__name__
            tags.add(str(tag))
    return tags - COVERED_EXTRA_KEYS
