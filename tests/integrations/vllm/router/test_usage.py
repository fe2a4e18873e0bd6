"""What a reply through the router says DualPath did (issue 28, deliver 2): the prefill
connector's `LoadReport` turned into `usage.prompt_tokens_details.cached_tokens` and the
`dualpath` usage extension, non-streamed and streamed, against stand-in instances
(`fake_instance.py`; `--recompute N` makes the prefill report its last N hit blocks
recomputed, as a connector whose load failed does)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fakes import BLOCK_BYTES, BS, PROMPT, Fake, routed, stats

from dualpath.core.blocks import block_keys
from dualpath.integrations.vllm.manifest import LoadReport, StoreManifest
from dualpath.integrations.vllm.router.policy import Route
from dualpath.integrations.vllm.router.usage import usage_report, with_usage
from dualpath.sched.types import ReadPlan
from dualpath.store import BlockStore

STORED = 3  # of PROMPT's 4 full blocks (17 tokens, block 4)


@pytest.fixture()
def hits(store: tuple[Path, StoreManifest]) -> tuple[Path, StoreManifest]:
    root, manifest = store
    blocks = BlockStore(root, BLOCK_BYTES, is_durable=False)
    for key in block_keys([ord(c) for c in PROMPT], BS, manifest.namespace_bytes)[:STORED]:
        blocks.put(key, bytes(BLOCK_BYTES))
    return store


def expected(pe: int, de: int, recomputed: int, path: str) -> tuple[int, dict[str, Any]]:
    return (pe + de) * BS, {"path": path, "pe_blocks": pe, "de_blocks": de,
                            "read_bytes_by_side": {"pe": pe * BLOCK_BYTES,
                                                   "de": de * BLOCK_BYTES},
                            "recomputed_blocks": recomputed}


@pytest.mark.parametrize(("recompute", "loads"), [(0, (STORED, 0, 0)), (1, (STORED - 1, 0, 1))])
def test_a_reply_says_what_was_loaded_and_recomputed(
        hits: tuple[Path, StoreManifest], fakes: Callable[..., Fake], recompute: int,
        loads: tuple[int, int, int]) -> None:
    p, d = fakes(None, "--recompute", str(recompute)), fakes()
    with routed(hits, [p], [d]) as client:
        reply = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT,
                                                      "max_tokens": 4}).json()
        cached, extension = expected(*loads, "pe")
        assert reply["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
        assert reply["usage"]["dualpath"] == extension
        assert reply["usage"]["prompt_tokens"] == len(PROMPT)  # the rest is the instance's
        s = stats(client)
        assert s["loaded_blocks_by_side"] == {"pe": loads[0], "de": loads[1]}
        assert s["recomputed_blocks"] == loads[2]
        text = client.get("/metrics").text
        assert f'dualpath_router:loaded_blocks_total{{model_name="m",side="pe"}} ' \
               f'{float(loads[0])}' in text


def test_a_stream_gets_it_in_its_usage_chunk_when_it_asks(
        hits: tuple[Path, StoreManifest], fakes: Callable[..., Fake]) -> None:
    p, d = fakes(), fakes()
    body: dict[str, Any] = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "stream": True}
    with routed(hits, [p], [d], forced_read_side="de") as client:
        for include in (True, False):
            opts = {"stream_options": {"include_usage": True}} if include else {}
            with client.stream("POST", "/v1/completions", json={**body, **opts}) as resp:
                raw = resp.read().decode()
            events = [x for x in raw.split("\n\n") if x]
            assert events[-1] == "data: [DONE]"
            chunks = [json.loads(x[6:]) for x in events[:-1]]
            with_use = [c for c in chunks if c.get("usage")]
            if not include:
                assert with_use == []
                continue
            (last,) = with_use
            cached, extension = expected(0, STORED, 0, "de")
            assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
            assert last["usage"]["dualpath"] == extension


def test_without_a_report_nothing_is_claimed() -> None:
    plan = ReadPlan(0, 1, 2, 1, BS)
    cached, extension = usage_report(Route(1, 0, 0, plan), None, BS, BLOCK_BYTES)
    assert cached == 0 and extension["path"] == "split"
    assert extension["pe_blocks"] is None and extension["recomputed_blocks"] is None
    none = Route(1, 0, 0, ReadPlan(0, 1, 0, 0, BS))
    assert usage_report(none, None, BS, BLOCK_BYTES) == (0, {
        "path": "none", "pe_blocks": 0, "de_blocks": 0,
        "read_bytes_by_side": {"pe": 0, "de": 0}, "recomputed_blocks": 0})
    assert usage_report(Route(1, 0, 0, plan), LoadReport(1, 0, 1), BS, BLOCK_BYTES)[0] == BS
    reply: dict[str, Any] = {"usage": None}
    assert not with_usage(reply, 5, {}) and reply == {"usage": None}
