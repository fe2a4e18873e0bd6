"""The router and the connectors count a prompt's stored prefix alike: the router's
`StoreManifest.hit_blocks`, the single-instance and the prefill connector's `Planner.match`,
all through `core.blocks.hit_blocks`, over the same keys in a real BlockStore."""

from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path
from typing import Any

import pytest

from dualpath.core.blocks import KeyScope, block_keys
from dualpath.integrations.vllm.connector.key_namespace import namespace_key
from dualpath.integrations.vllm.connector.plan import Planner
from dualpath.integrations.vllm.manifest import RouteParams, StoreManifest
from dualpath.integrations.vllm.router.scope import ModelCatalog, body_scope
from dualpath.store import BlockStore

BLOCK_BYTES = 8


def expected_hit(num_tokens: int, block_size: int, stored: set[int]) -> int:
    """The rule written out: leading stored full blocks, never the last prompt token."""
    n = 0
    while n in stored and (n + 1) * block_size <= num_tokens - 1:
        n += 1
    return n


def lengths(bs: int) -> list[int]:
    """Prompt lengths around the block edges: an exact multiple of the block size among them."""
    return sorted({1, max(bs - 1, 1), bs, bs + 1, 3 * bs, 3 * bs + 1, 5 * bs - 1})


def stored_sets(num_full: int) -> list[set[int]]:
    """Blocks stored: none, the first only, all but the last, every one, and a gap."""
    full = set(range(num_full))
    return [set(), {0} & full, set(range(max(num_full - 1, 0))), full, full - {1}]


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_router_and_connectors_agree_on_every_prompt(tmp_path: Path, bs: int) -> None:
    ns = namespace_key("agree", bs)
    manifest = StoreManifest(namespace=ns.hex(), model="m", block_size=bs,
                             full_block_bytes=BLOCK_BYTES)
    rid = itertools.count()
    checked = 0
    for num_tokens in lengths(bs):
        tokens = [(7 * i + num_tokens) % 50_000 for i in range(num_tokens)]
        keys = block_keys(tokens, bs, ns)
        for stored in stored_sets(len(keys)):
            store = BlockStore(tmp_path / f"s{next(rid)}", BLOCK_BYTES, is_durable=False)
            for i in sorted(stored):
                store.put(keys[i], bytes(BLOCK_BYTES))
            want = expected_hit(num_tokens, bs, stored)
            router = manifest.hit_blocks(tokens, store.contains)

            single = Planner(bs, ns, store.contains)
            single.add_request("r", tokens)
            prefill = Planner(bs, ns, store.contains, role="prefill")
            prefill.add_request("r", tokens, RouteParams(xfer="x", de="d:1",
                                                         hit_blocks=router, pe_blocks=router))
            where = f"bs={bs} tokens={num_tokens} stored={sorted(stored)}"
            assert router == want, where
            assert single.match("r", 0) == want * bs, where
            assert prefill.match("r", 0) == want * bs, where
            checked += 1
    assert checked == len(lengths(bs)) * 5


def test_a_router_count_above_the_rule_is_named_and_not_offered(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bs = 4
    store = BlockStore(tmp_path, BLOCK_BYTES, is_durable=False)
    planner = Planner(bs, namespace_key("agree", bs), store.contains, role="prefill")
    tokens = list(range(3 * bs))  # 3 full blocks, 2 may hit
    with caplog.at_level(logging.WARNING):
        planner.add_request("r", tokens, RouteParams(xfer="x", de="d:1", hit_blocks=3,
                                                     pe_blocks=3))
    assert "hit_blocks=3 exceeds the 2 blocks" in caplog.text
    assert planner.match("r", 0) == 2 * bs


def test_router_and_connectors_agree_within_each_tenant_and_adapter(tmp_path: Path) -> None:
    """Blocks stored under one scope are hits for that scope only, by the router's count
    (its scope from the request body) and the connectors' alike."""
    bs = 4
    ns = namespace_key("agree", bs)
    manifest = StoreManifest(namespace=ns.hex(), model="m", block_size=bs,
                             full_block_bytes=BLOCK_BYTES)
    catalog = ModelCatalog(_no_fetch, "m")
    catalog.learn({"data": [{"id": "m"}, {"id": "ad", "root": "/lora/ad", "parent": "m"}]})
    tokens = list(range(5 * bs))
    bodies = {"none": {"model": "m"}, "salt a": {"model": "m", "cache_salt": "a"},
              "salt b": {"model": "m", "cache_salt": "b"}, "adapter": {"model": "ad"},
              "adapter, salt a": {"model": "ad", "cache_salt": "a"}}
    scopes = {name: asyncio.run(body_scope(body, False, catalog)) for name, body in bodies.items()}
    for writer, scope in scopes.items():
        store = BlockStore(tmp_path / writer.replace(" ", "_").replace(",", ""), BLOCK_BYTES,
                           is_durable=False)
        for key in block_keys(tokens, bs, ns, scope):
            store.put(key, bytes(BLOCK_BYTES))
        for reader, read_scope in scopes.items():
            want = 4 if reader == writer else 0
            router = manifest.hit_blocks(tokens, store.contains, scope=read_scope)
            single = Planner(bs, ns, store.contains)
            single.add_request("r", tokens, scope=read_scope)
            assert (router, single.match("r", 0)) == (want, want * bs), (writer, reader)


async def _no_fetch() -> Any:
    raise OSError("no instance")


def test_a_request_the_connector_cannot_key_neither_loads_nor_saves(tmp_path: Path) -> None:
    bs = 4
    ns = namespace_key("agree", bs)
    store = BlockStore(tmp_path, BLOCK_BYTES, is_durable=False)
    tokens = list(range(5 * bs))
    for key in block_keys(tokens, bs, ns):
        store.put(key, bytes(BLOCK_BYTES))
    planner = Planner(bs, ns, store.contains)
    planner.add_request("r", tokens, scope=None)
    assert planner.match("r", 0) == 0 and not planner.is_keyed("r")
    planner.schedule_new("r", list(range(5)), 0, len(tokens))
    assert planner.take_plan().saves == []
    prefill = Planner(bs, ns, store.contains, role="prefill")
    prefill.add_request("r", tokens, RouteParams(xfer="x", de="d:1", hit_blocks=4,
                                                 pe_blocks=4), scope=None)
    assert prefill.match("r", 0) == 0  # the router's count is not trusted for it either
    prefill.schedule_new("r", list(range(5)), 0, len(tokens))
    (push,) = prefill.take_plan().pushes  # its own KV still goes to the decode instance
    assert push.xfer == "x"


def test_the_router_counts_no_hit_for_media_embeddings_or_an_unknown_adapter() -> None:
    catalog = ModelCatalog(_no_fetch, "m")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    for body, is_chat in [
            ({"messages": [{"role": "user", "content": [image]}]}, True),
            ({"prompt": "x", "prompt_embeds": "AAAA"}, False),
            ({"model": "nobody", "prompt": "x"}, False)]:
        assert asyncio.run(body_scope(body, is_chat, catalog)) is None, body
    text = {"type": "text", "text": "hi"}
    assert asyncio.run(body_scope({"messages": [{"role": "user", "content": [text]}]}, True,
                                  catalog)) == KeyScope()
