"""Polling the instances: each instance's `/health` and `/metrics` every `poll_interval_s`,
its KV cache usage and capacity (the decode instances' free KV memory; absent values are
tolerated) into the policy, and whether it is up into `failover.Liveness`.

Only instances no node report covers are polled (`intake`: nodes that push their state are
not asked), and a round's polls are spread over the interval in `SLICES`, so a thousand plain
instances do not all answer at once."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from http import HTTPStatus

from prometheus_client.parser import text_string_to_metric_families

from dualpath.integrations.vllm.router.client import Pool, UpstreamError
from dualpath.integrations.vllm.router.config import RouterConfig
from dualpath.integrations.vllm.router.failover import Liveness
from dualpath.integrations.vllm.router.policy import InstanceMetrics, RoutePolicy
from dualpath.sched.types import Role

log = logging.getLogger("dualpath.route")

SLICES = 10
"""Parts of a poll interval a round's polls are spread over."""
INLINE_PARSE_BYTES = 16 * 1024
_USED_SAMPLE = re.compile(
    r"^(?:vllm:num_requests_running|vllm:num_requests_waiting|vllm:kv_cache_usage_perc"
    r"|vllm:gpu_cache_usage_perc|vllm:cache_config_info)[{ \t].*$", re.MULTILINE)
"""The sample lines of the `/metrics` families `parse_vllm_metrics` reads."""


def parse_vllm_metrics(text: str, kv_bytes_per_token: float) -> InstanceMetrics:
    """The loads a vLLM `/metrics` page shows (summed over its engines; KV usage the highest;
    a quantity the page lacks is None). Only the sample lines of the families it reads are
    parsed: the page's histograms (most of it) would cost many times more."""
    running: float | None = None
    waiting: float | None = None
    usage: float | None = None
    capacity: float | None = None
    wanted = "\n".join(_USED_SAMPLE.findall(text))
    for family in text_string_to_metric_families(wanted + "\n" if wanted else ""):
        for s in family.samples:
            if s.name == "vllm:num_requests_running":
                running = (running or 0.0) + s.value
            elif s.name == "vllm:num_requests_waiting":
                waiting = (waiting or 0.0) + s.value
            elif s.name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                usage = s.value if usage is None else max(usage, s.value)
            elif s.name == "vllm:cache_config_info":
                blocks, size = s.labels.get("num_gpu_blocks"), s.labels.get("block_size")
                if blocks and size and blocks.isdigit() and size.isdigit():
                    capacity = (capacity or 0.0) + int(blocks) * int(size) * kv_bytes_per_token
    return InstanceMetrics(
        running=None if running is None else int(running),
        waiting=None if waiting is None else int(waiting),
        kv_usage=usage, kv_capacity_bytes=None if capacity is None else int(capacity))


class Poller:
    """Polls the instances no report covers, forever, once started; `on_round` runs after
    each round (the router places the requests waiting)."""

    def __init__(self, cfg: RouterConfig, policy: RoutePolicy, liveness: Liveness,
                 pool: Callable[[Role, int], Pool], on_round: Callable[[], None],
                 is_covered: Callable[[Role, int], bool] = lambda role, index: False) -> None:
        self.cfg = cfg
        self.policy = policy
        self.liveness = liveness
        self.pool = pool
        self.on_round = on_round
        self.is_covered = is_covered
        """Whether a node's report covers an instance (it is not polled then)."""
        self._polling: set[tuple[Role, int]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        m = cfg.manifest
        self.kv_bytes_per_token = m.full_block_bytes / m.block_size
        self.errors: Counter[tuple[str, str]] = Counter()
        """(role, url) -> polls of that instance that failed."""
        self.num_polls = 0

    async def poll_forever(self) -> None:
        """A round every `poll_interval_s`, its polls spread over the interval; an instance
        whose last poll has not ended yet is not asked again."""
        try:
            while True:
                targets = [(role, i, url) for role, i, url in self.cfg.instances()
                           if not self.is_covered(role, i) and (role, i) not in self._polling]
                per_slice = -(-len(targets) // SLICES)
                for k in range(SLICES):
                    for role, i, url in targets[k * per_slice:(k + 1) * per_slice]:
                        if self.is_covered(role, i):  # a report came since the round began
                            continue
                        self._polling.add((role, i))
                        task = asyncio.create_task(self.poll(role, i, url))
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
                    await asyncio.sleep(self.cfg.poll_interval_s / SLICES)
                self.on_round()
        finally:
            for task in self._tasks:
                task.cancel()

    async def poll(self, role: Role, index: int, url: str) -> None:
        """One instance's `/health` and `/metrics`: its loads into the policy, and whether it
        is up (any failure marks it down; a failed poll keeps the last sample)."""
        timeout = max(1.0, 2 * self.cfg.poll_interval_s)
        polled_at = time.monotonic()
        self.num_polls += 1
        pool = self.pool(role, index)
        try:
            await self._poll(role, index, url, pool, timeout, polled_at)
        finally:
            self._polling.discard((role, index))

    async def _poll(self, role: Role, index: int, url: str, pool: Pool, timeout: float,
                    polled_at: float) -> None:
        try:
            async with asyncio.timeout(2 * timeout):
                health = await pool.request("GET", "/health", timeout_s=timeout)
                if health.status != HTTPStatus.OK:
                    raise ValueError(f"/health answered HTTP {health.status}")
                page = await pool.request("GET", "/metrics", timeout_s=timeout)
            if page.status != HTTPStatus.OK:
                raise ValueError(f"/metrics answered HTTP {page.status}")
            # A large page (vLLM's, with its histograms) is parsed off the event loop.
            sample = parse_vllm_metrics(page.text, self.kv_bytes_per_token) \
                if len(page.body) < INLINE_PARSE_BYTES else await asyncio.to_thread(
                    parse_vllm_metrics, page.text, self.kv_bytes_per_token)
        except (UpstreamError, ValueError, TimeoutError) as e:
            self.errors[(role.value, url)] += 1
            log.debug("poll of %s: %s", url, e)
            self.liveness.mark_down(role, index, f"poll failed: {type(e).__name__}: {e}"[:300])
            return
        self.policy.update_metrics(role, index, sample)
        self.liveness.mark_up(role, index, polled_at)
