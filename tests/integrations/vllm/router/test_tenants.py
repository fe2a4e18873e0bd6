"""The router counts a prompt's stored prefix within the request's tenant and adapter: blocks
stored under one cache salt or LoRA adapter are hits for that one only, as the connectors key
them (the adapter's path from the instances' `/v1/models`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fakes import BLOCK_BYTES, BS, PROMPT, Fake, routed

from dualpath.core.blocks import KeyScope, block_keys
from dualpath.integrations.vllm.manifest import RouteParams, StoreManifest
from dualpath.store import BlockStore

HIT = (len(PROMPT) - 1) // BS
"""Every full block but the one holding the last prompt token."""


def _stored_under(store: tuple[Path, StoreManifest], scope: KeyScope) -> None:
    root, manifest = store
    blocks = BlockStore(root, BLOCK_BYTES, is_durable=False)
    tokens = [ord(c) for c in PROMPT]
    for key in block_keys(tokens, BS, manifest.namespace_bytes, scope):
        blocks.put(key, bytes(BLOCK_BYTES))


def _hit(prefill: Fake, n: int) -> int:
    params = RouteParams.from_params(prefill.bodies("/v1/completions")[n]["kv_transfer_params"])
    assert params is not None
    return params.hit_blocks


@pytest.mark.parametrize(("stored", "asked", "want"), [
    (KeyScope(cache_salt="a"), {"cache_salt": "a"}, HIT),
    (KeyScope(cache_salt="a"), {"cache_salt": "b"}, 0),
    (KeyScope(cache_salt="a"), {}, 0),
    (KeyScope(), {"cache_salt": "a"}, 0),
    (KeyScope(adapter=("ad", "/lora/ad")), {"model": "ad"}, HIT),
    (KeyScope(adapter=("ad", "/lora/ad")), {}, 0),
    (KeyScope(), {"model": "ad"}, 0),
    (KeyScope(), {"model": "nobody"}, 0),
], ids=["same salt", "other salt", "no salt", "salted asks unsalted", "same adapter",
        "base asks adapter's", "adapter asks base's", "unknown model"])
def test_hits_are_counted_within_the_request_scope(
        store: tuple[Path, StoreManifest], fakes: Callable[..., Fake], stored: KeyScope,
        asked: dict[str, Any], want: int) -> None:
    _stored_under(store, stored)
    prefill, decode = fakes(), fakes()
    with routed(store, [prefill], [decode]) as client:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 2, **asked}
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
    assert _hit(prefill, 0) == want


def test_a_bad_cache_salt_is_a_400_naming_it(store: tuple[Path, StoreManifest],
                                              fakes: Callable[..., Fake]) -> None:
    with routed(store, [fakes()], [fakes()]) as client:
        resp = client.post("/v1/completions", json={"prompt": PROMPT, "cache_salt": 7})
    assert resp.status_code == 400 and "cache_salt" in resp.text
