"""`dualpath route-report`: a node's reporter, the paper's leader engine. Beside a node's vLLM
instances (its GPUs, or its data-parallel ranks), it reads each one's `/health` and
`/metrics` on the node itself and pushes one `reports.NodeReport` for all of them to the router
every interval, so the router asks nothing of them (`intake`).

A router that is down or restarting is told again at the next interval: reports carry no
history, so a restarted router knows every node's engines one interval after it is back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from http import HTTPStatus

from dualpath.integrations.vllm.reports import REPORT_PATH, EngineState, NodeReport
from dualpath.integrations.vllm.router.client import Pool, UpstreamError
from dualpath.integrations.vllm.router.scrape import parse_vllm_metrics

log = logging.getLogger("dualpath.route")

StateOf = Callable[[str], Awaitable[EngineState]]


async def scraped_state(pool: Pool, url: str, timeout_s: float) -> EngineState:
    """An instance's state from its `/health` and `/metrics` (down when either fails)."""
    try:
        async with asyncio.timeout(2 * timeout_s):
            health = await pool.request("GET", "/health", timeout_s=timeout_s)
            if health.status != HTTPStatus.OK:
                return EngineState(url, False)
            page = await pool.request("GET", "/metrics", timeout_s=timeout_s)
    except (UpstreamError, TimeoutError):
        return EngineState(url, False)
    if page.status != HTTPStatus.OK:
        return EngineState(url, True)
    m = await asyncio.to_thread(parse_vllm_metrics, page.text, 1.0)
    return EngineState(url, True, m.running, m.waiting, m.kv_usage, m.kv_capacity_bytes)


async def report_forever(router_url: str, node: str, engines: Sequence[str], state_of: StateOf,
                         interval_s: float, api_key: str | None = None) -> None:
    """Every `interval_s`, the state of `engines` (`state_of`) to the router at `router_url`
    as node `node`'s report."""
    router = Pool(router_url, connect_timeout_s=max(1.0, interval_s),
                  read_timeout_s=max(1.0, 2 * interval_s))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    is_reaching = True
    try:
        while True:
            began = time.monotonic()
            states = await asyncio.gather(*(state_of(url) for url in engines))
            # Wall-clock microseconds: a restarted reporter's reports still come after its
            # earlier ones.
            report = NodeReport(node, interval_s, tuple(states), time.time_ns() // 1000)
            try:
                reply = await router.request("POST", REPORT_PATH, report.to_json(), headers)
                if reply.status != HTTPStatus.OK:
                    raise UpstreamError(f"HTTP {reply.status}: {reply.text[:200]}")
                unknown = reply.json().get("unknown")
                if unknown:
                    log.warning("node %s: the router routes to none of %s", node, unknown)
                if not is_reaching:
                    log.warning("node %s: reporting to %s again", node, router_url)
                is_reaching = True
            except (UpstreamError, ValueError) as e:
                if is_reaching:
                    log.warning("node %s: cannot report to %s (%s); trying every %g s", node,
                                router_url, e, interval_s)
                is_reaching = False
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - began)))
    finally:
        router.close()


async def report_node(router_url: str, node: str, engines: Sequence[str], interval_s: float,
                      api_key: str | None = None) -> None:
    """`report_forever` with each engine's state scraped from it."""
    pools = {url: Pool(url, connect_timeout_s=1.0, read_timeout_s=max(1.0, interval_s))
             for url in engines}

    async def state_of(url: str) -> EngineState:
        return await scraped_state(pools[url], url, max(1.0, interval_s))

    try:
        await report_forever(router_url, node, engines, state_of, interval_s, api_key)
    finally:
        for pool in pools.values():
            pool.close()
