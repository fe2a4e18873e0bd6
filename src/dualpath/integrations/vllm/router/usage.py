"""What a reply tells the client about its prompt's stored prefix: `cached_tokens` and the
`dualpath` usage extension, in a whole reply or in a stream's events."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

from dualpath.integrations.vllm.manifest import LoadReport
from dualpath.integrations.vllm.router.policy import Route

_EVENT_END = re.compile(rb"\r?\n\r?\n")
DONE_EVENT = b"data: [DONE]\n\n"


def usage_report(route: Route, report: LoadReport | None, block_size: int,
                 full_block_bytes: int) -> tuple[int, dict[str, Any]]:
    """A request's `cached_tokens` and its `dualpath` usage extension, from the prefill
    connector's `LoadReport` (what actually loaded; None: it sent none, so nothing is known
    to have loaded and the counts are null)."""
    if report is None and route.plan.num_hit_blocks == 0:
        report = LoadReport(0, 0, 0)
    if report is None:
        return 0, {"path": route.path, "pe_blocks": None, "de_blocks": None,
                   "read_bytes_by_side": None, "recomputed_blocks": None}
    return (report.pe_blocks + report.de_blocks) * block_size, {
        "path": route.path, "pe_blocks": report.pe_blocks, "de_blocks": report.de_blocks,
        "read_bytes_by_side": {"pe": report.pe_blocks * full_block_bytes,
                               "de": report.de_blocks * full_block_bytes},
        "recomputed_blocks": report.recomputed_blocks}


def with_usage(reply: Any, cached_tokens: int, extension: dict[str, Any]) -> bool:
    """Put `cached_tokens` (`usage.prompt_tokens_details`) and the `dualpath` extension in
    a reply's (or a stream chunk's) usage, in place; False when it has none."""
    usage = reply.get("usage") if isinstance(reply, dict) else None
    if not isinstance(usage, dict):
        return False
    details = usage.get("prompt_tokens_details")
    usage["prompt_tokens_details"] = {**(details if isinstance(details, dict) else {}),
                                      "cached_tokens": cached_tokens}
    usage["dualpath"] = extension
    return True


def with_usage_event(event: bytes, cached_tokens: int, extension: dict[str, Any]) -> bytes:
    """A stream event with the usage filled in as `with_usage` does (others unchanged)."""
    if not event.startswith(b"data: {") or b'"usage"' not in event:
        return event
    body = event[len(b"data: "):].rstrip(b"\r\n")
    try:
        chunk = json.loads(body)
    except ValueError:
        return event
    if not with_usage(chunk, cached_tokens, extension):
        return event
    return b"data: " + json.dumps(chunk).encode() + event[len(b"data: ") + len(body):]



async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A server-sent event stream's events, each with its blank line (a stream that ends
    without one yields its tail as the last event)."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        while (m := _EVENT_END.search(buf)) is not None:
            yield buf[:m.end()]
            buf = buf[m.end():]
    if buf:
        yield buf

