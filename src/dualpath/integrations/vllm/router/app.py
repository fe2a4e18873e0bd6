"""`dualpath route`: an OpenAI-compatible router in front of P prefill and D decode vLLM
instances running `DualPathConnector`, deciding with the one `sched.scheduler.Scheduler`
(`route_policy.RoutePolicy`; this module does the HTTP and nothing else decides).

Per request (`/v1/completions`, `/v1/chat/completions`):
1. the prompt's token ids from a prefill instance's `/tokenize` (instances in turn);
2. its stored prefix: the connectors' block keys (the store's `StoreManifest`) looked up in
   the `BlockStore`;
3. the scheduler places it: a prefill and a decode instance and a `ReadPlan` (blocks
   `[0, pe_blocks)` read by the prefill instance, the rest of the hits by the decode
   instance); a request that cannot be placed yet waits, and is placed when a reply or a
   metrics poll frees room, or answered 503 after `queue_timeout_s`;
4. the client's body with `max_tokens` 1 (and `max_completion_tokens` 1 for chat), no
   streaming, `n` 1 and `kv_transfer_params = RouteParams(...).to_params()` to the prefill
   instance;
5. the client's original body plus the prefill reply's `kv_transfer_params` (none if it had
   none: the decode instance then recomputes) to the decode instance;
6. the decode instance's reply back to the client (SSE passed through when streaming).

Errors have OpenAI's shape: 400 for a bad body, 401 without the API key, 408 / 413 for a
body too slow or too large, 502 for an instance that is unreachable or fails (5xx), 504 for
one that times out (both name the instance's URL), 503 when no instance could take the
request in time; an instance's own 4xx is passed through. The API key, the body's limits and
the connection timeouts are `dualpath.http`'s, the same as `dualpath serve`'s. Each
instance's `/health` and `/metrics` are polled every `poll_interval_s`: its KV cache usage
and capacity (the decode instances' free KV memory; absent values are tolerated), and
whether it is up.

Failover: an instance whose poll fails (refused, reset, timed out, not 200), or that refuses
or drops a request's connection, is marked down at once and takes no new requests
(`RoutePolicy.mark_down`); the first poll it answers brings it back. A request whose prefill
or decode instance fails it (unreachable, dropped, 5xx) before anything reached the client
is placed again from the start, once (`RoutePolicy.requeue`: new instances, a new transfer
id, a new read plan; its KV is read from the store or recomputed, never taken from the failed
attempt). A stream that breaks after its first event ends with an error event and
`data: [DONE]`. `/health` says `degraded` while an instance is down, `unavailable` (503)
while every prefill or every decode instance is.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

import httpx2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from dualpath.core.errors import SpecError
from dualpath.core.store import BlockStore
from dualpath.http import exposition
from dualpath.http.api_error import ApiError, add_error_handlers, bad_request, server_error
from dualpath.integrations.vllm.manifest import LoadReport, RouteParams, StoreManifest
from dualpath.integrations.vllm.router.policy import InstanceMetrics, Route, RoutePolicy
from dualpath.sched.mode import mode_preset
from dualpath.sched.params import SchedulerParams
from dualpath.sched.types import Role

log = logging.getLogger("dualpath.route")

PREFILL_DROPPED = ("stream_options", "min_tokens", "max_completion_tokens")
CHAT_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template",
                        "chat_template_kwargs", "tools", "documents", "add_special_tokens")
"""Chat fields that change the prompt's tokens, forwarded to `/tokenize`."""
RETRIES = 1
"""Times a request failed by an instance before its first token is placed again."""
STAT_THREADS = 32
"""Parallel store checks of one prompt's blocks (on NFS a `stat` is a round trip)."""
REQUEST_ID_HEADER = "X-Request-Id"
"""The trace id header (vLLM's convention: its request ids are built from it)."""
_EVENT_END = re.compile(rb"\r?\n\r?\n")
_USED_SAMPLE = re.compile(
    r"^(?:vllm:num_requests_running|vllm:num_requests_waiting|vllm:kv_cache_usage_perc"
    r"|vllm:gpu_cache_usage_perc|vllm:cache_config_info)[{ \t].*$", re.MULTILINE)
"""The sample lines of the `/metrics` families `parse_vllm_metrics` reads."""
_DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class RouterConfig:
    """The instances, the store and the policy of one router."""

    prefill: tuple[str, ...]
    """Base URLs of the prefill instances (`http://host:port`)."""
    decode: tuple[str, ...]
    sides: tuple[str, ...]
    """host:port of each decode instance's side channel (`RouteParams.de`)."""
    store: Path
    manifest: StoreManifest
    params: SchedulerParams
    mode: str
    model: str | None = None
    """The model name put in a request that names none (default: the instances' choice)."""
    queue_timeout_s: float = 60.0
    upstream_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    poll_interval_s: float = 0.5
    decode_kv_capacity_bytes: int | None = None
    forced_read_side: str | None = None
    """"pe" / "de": every hit read on that side (`--force-read-side`)."""

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise SpecError("route", "instances", (len(self.prefill), len(self.decode)),
                            "needs at least one --prefill and one --decode")
        if len(self.sides) != len(self.decode):
            raise SpecError("route", "side", len(self.sides),
                            f"one --side per --decode ({len(self.decode)} given)")
        for url in (*self.prefill, *self.decode):
            if not url.startswith(("http://", "https://")):
                raise SpecError("route", "url", url, "must start with http:// or https://")
        for side in self.sides:
            host, _, port = side.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise SpecError("route", "side", side, "must be HOST:PORT")
        for name in ("queue_timeout_s", "upstream_timeout_s", "connect_timeout_s",
                     "poll_interval_s"):
            if not getattr(self, name) > 0:
                raise SpecError("route", name, getattr(self, name), "must be > 0")

    @property
    def model_name(self) -> str:
        return self.model or self.manifest.model

    @property
    def is_round_robin(self) -> bool:
        """Basic's "w/o scheduling", round robin over the instances: the mode's
        (`sched.mode.mode_preset`), as `policy.route_params` gives it."""
        return mode_preset(self.mode).is_round_robin


def parse_vllm_metrics(text: str, kv_bytes_per_token: float) -> InstanceMetrics:
    """The loads a vLLM `/metrics` page shows (summed over its engines; KV usage the highest;
    a quantity the page lacks is None). Only the sample lines of the families it reads are
    parsed: the page's histograms (most of its 100+ KiB) cost 50 ms a page otherwise."""
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


def prefill_body(body: dict[str, Any], is_chat: bool, params: RouteParams) -> dict[str, Any]:
    """What the prefill instance gets: one token, no stream, one choice, the router's orders."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
    out.update(max_tokens=1, stream=False, n=1, kv_transfer_params=params.to_params())
    if is_chat:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: Any) -> dict[str, Any]:
    """The client's body with the prefill reply's `kv_transfer_params` (if it had any)."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if kv_transfer_params:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def _gen_tokens(body: dict[str, Any]) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad_request(name, "must be a non-negative integer")
            return int(value)
    return 0


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


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


def _with_usage_event(event: bytes, cached_tokens: int, extension: dict[str, Any]) -> bytes:
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


def _is_broken(exc: httpx2.HTTPError) -> bool:
    """Whether a failed exchange says the instance is gone (refused, reset, dropped mid-reply,
    no connection in time), rather than slow."""
    return isinstance(exc, httpx2.NetworkError | httpx2.RemoteProtocolError
                      | httpx2.ConnectTimeout)


async def sse_events(resp: httpx2.Response) -> AsyncIterator[bytes]:
    """A server-sent event stream's events, each with its blank line (a stream that ends
    without one yields its tail as the last event)."""
    buf = b""
    async for chunk in resp.aiter_bytes():
        buf += chunk
        while (m := _EVENT_END.search(buf)) is not None:
            yield buf[:m.end()]
            buf = buf[m.end():]
    if buf:
        yield buf


@dataclass(frozen=True)
class Down:
    """Why and since when an instance is marked down."""

    reason: str
    since: float
    """`time.monotonic()` when it was marked."""


class _Retry(Exception):
    """An instance failed the request before anything reached the client: place it again."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


class Router:
    """The policy, the store, the HTTP client and the requests waiting for a placement."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        m = cfg.manifest
        self.policy = RoutePolicy(cfg.params, len(cfg.prefill), len(cfg.decode),
                                  cfg.is_round_robin, cfg.decode_kv_capacity_bytes,
                                  cfg.forced_read_side)
        self.store = BlockStore(cfg.store, m.file_bytes, is_durable=False)
        self.kv_bytes_per_token = m.full_block_bytes / m.block_size
        self._ids = itertools.count(1)
        self._tokenize_turn = itertools.count()
        self._waiters: dict[int, asyncio.Future[Route]] = {}
        self.upstream_errors: Counter[tuple[str, str]] = Counter()
        """(role, url) -> errors (unreachable, timeout, 5xx) of that instance."""
        self.poll_errors: Counter[tuple[str, str]] = Counter()
        self.num_queue_timeouts = 0
        self.num_retries = 0
        self.loaded_blocks: Counter[str] = Counter()
        """Blocks the prefill connectors reported loaded, per read side, and "recomputed"."""
        self.num_stream_errors = 0
        """Streams that broke after their first event (ended with an error event)."""
        self.down: dict[tuple[Role, int], Down] = {}
        self._client: httpx2.AsyncClient | None = None
        self._poller: asyncio.Task[None] | None = None
        self._stat_threads = ThreadPoolExecutor(STAT_THREADS, thread_name_prefix="dualpath-stat")
        """Where a prompt's stored-prefix checks run, a wave at a time (`manifest.in_waves`)."""

    # -- life ------------------------------------------------------------------------------
    async def start(self) -> None:
        timeout = httpx2.Timeout(self.cfg.upstream_timeout_s, connect=self.cfg.connect_timeout_s)
        limits = httpx2.Limits(max_connections=None, max_keepalive_connections=256)
        self._client = httpx2.AsyncClient(timeout=timeout, limits=limits)
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._client is not None:
            await self._client.aclose()
        self._stat_threads.shutdown(wait=False, cancel_futures=True)

    @property
    def client(self) -> httpx2.AsyncClient:
        if self._client is None:
            raise RuntimeError("router not started")
        return self._client

    def instances(self) -> Iterator[tuple[Role, int, str]]:
        for i, url in enumerate(self.cfg.prefill):
            yield Role.PREFILL, i, url
        for j, url in enumerate(self.cfg.decode):
            yield Role.DECODE, j, url

    def url_of(self, role: Role, index: int) -> str:
        return (self.cfg.prefill if role is Role.PREFILL else self.cfg.decode)[index]

    # -- instances up and down -------------------------------------------------------------
    def mark_down(self, role: Role, index: int, reason: str) -> None:
        """The instance takes no new requests until a poll finds it answering again."""
        if (role, index) in self.down:
            return
        self.down[(role, index)] = Down(reason, time.monotonic())
        self.policy.mark_down(role, index)
        log.warning("%s instance %s is down (%s): no new requests until it answers again",
                    role.value, self.url_of(role, index), reason)
        self._place()

    def mark_up(self, role: Role, index: int, polled_at: float) -> None:
        """Back in service, unless it went down after this poll began (a poll in flight when a
        request found the instance dead may still have been answered by it)."""
        gone = self.down.get((role, index))
        if gone is None or gone.since >= polled_at:
            return
        del self.down[(role, index)]
        self.policy.mark_up(role, index)
        log.warning("%s instance %s is back after %.1f s", role.value,
                    self.url_of(role, index), time.monotonic() - gone.since)
        self._place()

    def health(self) -> tuple[str, list[dict[str, Any]]]:
        """("ok" | "degraded" | "unavailable", the instances down): unavailable while every
        prefill or every decode instance is down."""
        now = time.monotonic()
        down = [{"role": role.value, "url": self.url_of(role, i), "reason": d.reason,
                 "down_s": round(now - d.since, 1)} for (role, i), d in self.down.items()]
        if not down:
            return "ok", down
        roles = Counter(role for role, _ in self.down)
        if roles[Role.PREFILL] == len(self.cfg.prefill) or \
                roles[Role.DECODE] == len(self.cfg.decode):
            return "unavailable", down
        return "degraded", down

    # -- polling ---------------------------------------------------------------------------
    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.poll(role, i, url) for role, i, url in self.instances()))
            self._place()
            await asyncio.sleep(self.cfg.poll_interval_s)

    async def poll(self, role: Role, index: int, url: str) -> None:
        """One instance's `/health` and `/metrics`: its loads into the policy, and whether it
        is up (any failure marks it down; a failed poll keeps the last sample)."""
        timeout = max(1.0, 2 * self.cfg.poll_interval_s)
        polled_at = time.monotonic()
        try:
            health = await self.client.get(f"{url}/health", timeout=timeout)
            if health.status_code != HTTPStatus.OK:
                raise ValueError(f"/health answered HTTP {health.status_code}")
            resp = await self.client.get(f"{url}/metrics", timeout=timeout)
            resp.raise_for_status()
            # Off the event loop: 40 instances' pages every 0.5 s held it for a second.
            sample = await asyncio.to_thread(parse_vllm_metrics, resp.text,
                                             self.kv_bytes_per_token)
        except (httpx2.HTTPError, ValueError) as e:
            self.poll_errors[(role.value, url)] += 1
            log.debug("poll of %s: %s", url, e)
            self.mark_down(role, index, f"poll failed: {type(e).__name__}: {e}"[:300])
            return
        self.policy.update_metrics(role, index, sample)
        self.mark_up(role, index, polled_at)

    # -- placement -------------------------------------------------------------------------
    def _place(self) -> None:
        """Run the scheduler and wake the requests it placed."""
        for route in self.policy.schedule():
            fut = self._waiters.pop(route.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(route)

    async def _placed(self, rid: int) -> Route:
        fut: asyncio.Future[Route] = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        self._place()
        try:
            return await asyncio.wait_for(fut, self.cfg.queue_timeout_s)
        except TimeoutError:
            self.num_queue_timeouts += 1
            _, down = self.health()
            why = "; down: " + ", ".join(f"{d['role']} {d['url']} ({d['reason']})"
                                         for d in down) if down else ""
            raise server_error(HTTPStatus.SERVICE_UNAVAILABLE, "no instance could take the "
                               f"request within {self.cfg.queue_timeout_s:g} s{why}") from None
        finally:
            self._waiters.pop(rid, None)

    def _release(self, rid: int, is_ok: bool) -> None:
        if self.policy.is_known(rid):
            if is_ok:
                self.policy.finished(rid)
            else:
                self.policy.abort(rid)
        self._place()

    # -- upstream --------------------------------------------------------------------------
    def _count_error(self, role: Role, url: str) -> None:
        """One more failure of the instance `url` (an endpoint of it) belongs to."""
        urls = self.cfg.prefill if role is Role.PREFILL else self.cfg.decode
        base = next((u for u in urls if url == u or url.startswith(u + "/")), url)
        self.upstream_errors[(role.value, base)] += 1

    def _upstream_error(self, role: Role, url: str, exc: httpx2.HTTPError,
                        index: int | None = None) -> ApiError:
        """The client's error for a failed exchange with an instance; one that says the
        instance is gone (`_is_broken`) marks it down (`index`: which one)."""
        self._count_error(role, url)
        if index is not None and _is_broken(exc):
            self.mark_down(role, index, f"{type(exc).__name__}: {exc}"[:300])
        if isinstance(exc, httpx2.TimeoutException):
            return server_error(HTTPStatus.GATEWAY_TIMEOUT, f"{role.value} instance {url} "
                                f"timed out: {type(exc).__name__}")
        return server_error(HTTPStatus.BAD_GATEWAY, f"{role.value} instance {url} "
                            f"unreachable: {type(exc).__name__}: {exc}")

    def _check_reply(self, role: Role, url: str, resp: httpx2.Response) -> None:
        """An instance's 4xx goes back to the client as it is; a 5xx is a 502."""
        if resp.status_code < 400:
            return
        if resp.status_code >= 500:
            self._count_error(role, url)
            raise server_error(HTTPStatus.BAD_GATEWAY, f"{role.value} instance {url} failed: "
                               f"HTTP {resp.status_code}: {resp.text[:500]}")
        raise _Passthrough(resp)

    async def _post(self, role: Role, url: str, body: dict[str, Any], index: int | None = None,
                    headers: dict[str, str] | None = None) -> httpx2.Response:
        try:
            resp = await self.client.post(url, json=body, headers=headers)
        except httpx2.HTTPError as e:
            raise self._upstream_error(role, url, e, index) from e
        self._check_reply(role, url, resp)
        return resp

    async def _post_or_retry(self, role: Role, index: int, url: str, body: dict[str, Any],
                             headers: dict[str, str]) -> httpx2.Response:
        """`_post` within a request's attempt: an instance gone or failing (5xx) is a
        `_Retry`; a timeout is not (the client has waited long enough)."""
        try:
            resp = await self.client.post(url, json=body, headers=headers)
        except httpx2.HTTPError as e:
            err = self._upstream_error(role, url, e, index)
            if _is_broken(e):
                raise _Retry(err) from e
            raise err from e
        try:
            self._check_reply(role, url, resp)
        except ApiError as e:
            raise _Retry(e) from e
        return resp

    # -- requests --------------------------------------------------------------------------
    async def tokens(self, body: dict[str, Any], is_chat: bool) -> list[int]:
        """The prompt's token ids (from a prefill instance's `/tokenize`, or the body's own)."""
        req: dict[str, Any] = {}
        model = body.get("model", self.cfg.model)
        if model is not None:
            req["model"] = model
        if is_chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise bad_request("messages", "must be a non-empty list")
            req["messages"] = messages
            req.update({k: body[k] for k in CHAT_TEMPLATE_FIELDS if k in body})
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and not _is_token_ids(prompt):
                prompt = prompt[0]
            if _is_token_ids(prompt) and prompt:
                return list(prompt)
            if not isinstance(prompt, str) or not prompt:
                raise bad_request("prompt", "must be one non-empty string or list of token "
                                  "ids (the router routes one prompt per request)")
            req["prompt"] = prompt
            if "add_special_tokens" in body:
                req["add_special_tokens"] = body["add_special_tokens"]
        # The prefill instances that are up in turn, then the decode instances (the same
        # model and template); one gone is marked down and the next one asked. With none
        # up, wait for one (a restart) as a request waits for a placement.
        deadline = time.monotonic() + self.cfg.queue_timeout_s
        while not (candidates := self._tokenizers()):
            if time.monotonic() > deadline:
                self.num_queue_timeouts += 1
                raise server_error(HTTPStatus.SERVICE_UNAVAILABLE, "no instance answered "
                                   f"within {self.cfg.queue_timeout_s:g} s to tokenize the "
                                   "prompt; down: " + ", ".join(
                                       f"{d['role']} {d['url']} ({d['reason']})"
                                       for d in self.health()[1]))
            await asyncio.sleep(min(self.cfg.poll_interval_s, 0.1))
        for k, (role, index) in enumerate(candidates):
            url = self.url_of(role, index) + "/tokenize"
            try:
                resp = await self._post(role, url, req, index)
                break
            except ApiError:
                if k == len(candidates) - 1 or self.policy.is_up(role, index):
                    raise
        try:
            ids = resp.json()["tokens"]
        except (ValueError, KeyError, TypeError):
            ids = None
        if not _is_token_ids(ids):
            self._count_error(role, url)
            raise server_error(HTTPStatus.BAD_GATEWAY, f"{role.value} instance {url}: no "
                               "token ids in its reply")
        return list(ids)

    def _tokenizers(self) -> list[tuple[Role, int]]:
        """The instances to ask for a prompt's tokens, in order: the prefill instances that
        are up, from the next in turn, then the decode instances that are up."""
        num = len(self.cfg.prefill)
        turn = next(self._tokenize_turn)
        prefill = [(Role.PREFILL, (turn + k) % num) for k in range(num)]
        decode = [(Role.DECODE, j) for j in range(len(self.cfg.decode))]
        return [(role, i) for role, i in prefill + decode if self.policy.is_up(role, i)]

    def hit_blocks(self, tokens: Sequence[int]) -> int:
        """The prompt's stored prefix in whole blocks, as the connectors will find it."""
        return self.cfg.manifest.hit_blocks(tokens, self.store.contains, self._stat_threads)

    async def handle(self, body: Any, is_chat: bool, trace_id: str | None = None) -> Response:
        """One completion or chat request, routed (the module docstring's steps); `trace_id`
        (the client's `X-Request-Id`, else a new one) goes to both instances and back."""
        if not isinstance(body, dict):
            raise bad_request(None, "the body must be a JSON object")
        is_stream = body.get("stream", False)
        if not isinstance(is_stream, bool):
            raise bad_request("stream", "must be true or false")
        if "model" not in body and self.cfg.model is not None:
            body = {**body, "model": self.cfg.model}
        gen = _gen_tokens(body)
        trace = trace_id or uuid.uuid4().hex
        tokens = await self.tokens(body, is_chat)
        hit = await asyncio.to_thread(self.hit_blocks, tokens)
        rid = next(self._ids)
        self.policy.submit(rid, len(tokens), hit, gen)
        is_handed_off = is_ok = False
        try:
            for attempt in itertools.count():
                try:
                    resp, is_handed_off = await self._attempt(rid, body, is_chat, is_stream,
                                                              trace)
                except _Retry as e:
                    if attempt >= RETRIES:
                        raise e.error from None
                    self.num_retries += 1
                    log.warning("request %s: %s; placed again", trace, e.error.message)
                    self.policy.requeue(rid)
                    continue
                is_ok = not is_handed_off
                resp.headers[REQUEST_ID_HEADER] = trace
                return resp
            raise AssertionError("unreachable")
        finally:
            if not is_handed_off:
                self._release(rid, is_ok)

    async def _attempt(self, rid: int, body: dict[str, Any], is_chat: bool, is_stream: bool,
                       trace: str) -> tuple[Response, bool]:
        """One placement of the request through a prefill and a decode instance: the
        response, and whether a stream took over the request's release. An instance that
        fails before anything reached the client raises `_Retry`."""
        route = await self._placed(rid)
        path = "/v1/chat/completions" if is_chat else "/v1/completions"
        headers = {REQUEST_ID_HEADER: trace}
        # A fresh transfer id and the decode instance of this placement: nothing of an
        # earlier attempt (slots staged or pushed on a failed instance) is ever read.
        params = RouteParams(xfer=uuid.uuid4().hex, de=self.cfg.sides[route.decode],
                             hit_blocks=route.plan.num_hit_blocks,
                             pe_blocks=route.plan.num_pe_blocks)
        pre = await self._post_or_retry(Role.PREFILL, route.prefill,
                                        self.cfg.prefill[route.prefill] + path,
                                        prefill_body(body, is_chat, params), headers)
        self.policy.prefill_done(rid)
        self._place()
        try:
            kv = pre.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            kv = None
        try:
            report = LoadReport.from_params(kv) if isinstance(kv, dict) else None
        except SpecError as e:
            log.warning("request %s: prefill instance %s: %s", trace,
                        self.cfg.prefill[route.prefill], e)
            report = None
        if report is not None:
            self.loaded_blocks.update(pe=report.pe_blocks, de=report.de_blocks,
                                      recomputed=report.recomputed_blocks)
        m = self.cfg.manifest
        cached, extension = usage_report(route, report, m.block_size, m.full_block_bytes)
        url = self.cfg.decode[route.decode] + path
        out = decode_body(body, kv)
        if not is_stream:
            resp = await self._post_or_retry(Role.DECODE, route.decode, url, out, headers)
            content = resp.content
            try:
                reply = json.loads(content)
            except ValueError:
                reply = None
            if with_usage(reply, cached, extension):
                content = json.dumps(reply).encode()
            return Response(content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type",
                                                        "application/json")), False
        stream = await self._open_stream(route.decode, url, out, headers)
        events = sse_events(stream)
        try:
            first = await anext(events, b"")
        except httpx2.HTTPError as e:
            await stream.aclose()
            err = self._upstream_error(Role.DECODE, url, e, route.decode)
            if _is_broken(e):
                raise _Retry(err) from e
            raise err from e
        except BaseException:
            await stream.aclose()
            raise
        usage = (cached, extension)
        return StreamingResponse(self._relay(rid, route.decode, url, stream, first, events,
                                             usage),
                                 media_type=stream.headers.get("content-type",
                                                               "text/event-stream")), True

    async def _open_stream(self, index: int, url: str, body: dict[str, Any],
                           headers: dict[str, str]) -> httpx2.Response:
        request = self.client.build_request("POST", url, json=body, headers=headers)
        try:
            resp = await self.client.send(request, stream=True)
        except httpx2.HTTPError as e:
            err = self._upstream_error(Role.DECODE, url, e, index)
            if _is_broken(e):
                raise _Retry(err) from e
            raise err from e
        if resp.status_code >= 400:
            try:
                await resp.aread()
            finally:
                await resp.aclose()
            try:
                self._check_reply(Role.DECODE, url, resp)
            except ApiError as e:
                raise _Retry(e) from e
        return resp

    async def _relay(self, rid: int, index: int, url: str, resp: httpx2.Response,
                     first: bytes, events: AsyncIterator[bytes],
                     usage: tuple[int, dict[str, Any]]) -> AsyncIterator[bytes]:
        """The decode instance's events to the client, whole, their usage (when the client
        asked for it) filled in; a stream that breaks ends with an error event and `[DONE]`
        (an event cut short is dropped, never half sent)."""
        is_ok = False
        try:
            if first:
                yield _with_usage_event(first, *usage)
            async for event in events:
                yield _with_usage_event(event, *usage)
            is_ok = True
        except httpx2.HTTPError as e:
            self.num_stream_errors += 1
            err = self._upstream_error(Role.DECODE, url, e, index)
            yield f"data: {json.dumps(err.body())}\n\n".encode() + _DONE_EVENT
        finally:
            await resp.aclose()
            self._release(rid, is_ok)

    async def models(self) -> Response:
        index = next((i for i in range(len(self.cfg.prefill))
                      if self.policy.is_up(Role.PREFILL, i)), 0)
        url = self.cfg.prefill[index] + "/v1/models"
        try:
            resp = await self.client.get(url)
        except httpx2.HTTPError as e:
            raise self._upstream_error(Role.PREFILL, url, e, index) from e
        self._check_reply(Role.PREFILL, url, resp)
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type", "application/json"))

    # -- numbers ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """`/stats`: the policy's numbers with the instances' URLs and the error counts."""
        snap = self.policy.snapshot(self.cfg.manifest.full_block_bytes)
        for role, urls in (("prefill", self.cfg.prefill), ("decode", self.cfg.decode)):
            for inst, url in zip(snap[role], urls, strict=True):
                inst["url"] = url
                inst["upstream_errors"] = self.upstream_errors[(role, url)]
                inst["metrics_poll_errors"] = self.poll_errors[(role, url)]
                down = self.down.get((Role(role), inst["index"]))
                inst["down_reason"] = None if down is None else down.reason
        for inst, side in zip(snap["decode"], self.cfg.sides, strict=True):
            inst["side_channel"] = side
        snap["loaded_blocks_by_side"] = {s: self.loaded_blocks[s] for s in ("pe", "de")}
        snap["recomputed_blocks"] = self.loaded_blocks["recomputed"]
        snap.update(mode=self.cfg.mode, model=self.cfg.model_name, health=self.health()[0],
                    retries=self.num_retries, stream_errors=self.num_stream_errors,
                    queue_timeouts=self.num_queue_timeouts,
                    block_size=self.cfg.manifest.block_size,
                    full_block_bytes=self.cfg.manifest.full_block_bytes)
        return snap


class _Passthrough(Exception):
    """An instance's own 4xx reply, returned to the client unchanged."""

    def __init__(self, resp: httpx2.Response) -> None:
        super().__init__(resp.status_code)
        self.resp = resp


class _RouterCollector(Collector):
    """`dualpath_router:*` from `Router.stats()` at scrape time (so they match `/stats`)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        s = self.router.stats()

        def one(kind: type[CounterMetricFamily] | type[GaugeMetricFamily], name: str,
                doc: str, labels: Sequence[str], rows: Sequence[exposition.Row]) -> Metric:
            return exposition.family(kind, f"dualpath_router:{name}", doc, s["model"], labels,
                                     rows)

        yield one(CounterMetricFamily, "requests", "Requests placed, per read path "
                  "(pe, de, split: both sides read, none: no stored prefix).", ["path"],
                  [((p,), n) for p, n in s["requests_by_path"].items()])
        yield one(CounterMetricFamily, "hit_blocks", "Stored KV blocks assigned to each "
                  "read side.", ["side"],
                  [((k,), n) for k, n in s["hit_blocks_by_side"].items()])
        yield one(CounterMetricFamily, "hit_bytes", "Stored KV bytes assigned to each read "
                  "side.", ["side"], [((k,), n) for k, n in s["hit_bytes_by_side"].items()])
        yield one(CounterMetricFamily, "loaded_blocks", "Stored KV blocks the prefill "
                  "instances' connectors reported loaded, per read side.", ["side"],
                  [((k,), n) for k, n in s["loaded_blocks_by_side"].items()])
        yield one(CounterMetricFamily, "recomputed_blocks", "Stored KV blocks planned to "
                  "load that were recomputed (a load failed).", [],
                  [((), s["recomputed_blocks"])])
        yield one(CounterMetricFamily, "finished_requests", "Requests answered.", [],
                  [((), s["finished"])])
        yield one(CounterMetricFamily, "aborted_requests", "Requests ended by an error, a "
                  "timeout or a client gone.", [], [((), s["aborted"])])
        yield one(CounterMetricFamily, "queue_timeouts", "Requests no instance took in "
                  "time (503).", [], [((), s["queue_timeouts"])])
        yield one(CounterMetricFamily, "retries", "Requests placed again after an instance "
                  "failed them before their first token.", [], [((), s["retries"])])
        yield one(CounterMetricFamily, "stream_errors", "Streams that broke after their "
                  "first event (ended with an error event).", [], [((), s["stream_errors"])])
        yield one(GaugeMetricFamily, "waiting_requests", "Requests not yet placed.", [],
                  [((), s["waiting"])])
        instances = [(role, inst) for role in ("prefill", "decode") for inst in s[role]]
        labels = ["role", "instance", "node"]

        def rows(key: str) -> list[exposition.Row]:
            return [((role, inst["url"], str(inst["node"])), inst[key])
                    for role, inst in instances if inst.get(key) is not None]

        yield one(GaugeMetricFamily, "read_queue_tokens", "Hit tokens queued on the node's "
                  "storage NIC (requests whose prefill has not replied).", labels,
                  rows("read_queue_tokens"))
        yield one(GaugeMetricFamily, "up", "1 while the instance takes new requests, 0 "
                  "while it is marked down.", labels,
                  [((role, inst["url"], str(inst["node"])), int(inst["up"]))
                   for role, inst in instances])
        yield one(GaugeMetricFamily, "in_flight_requests", "Requests routed to the "
                  "instance and not done with it.", labels, rows("in_flight"))
        yield one(GaugeMetricFamily, "in_flight_tokens", "Prompt tokens of those "
                  "requests.", labels, rows("in_flight_tokens"))
        yield one(GaugeMetricFamily, "free_kv_bytes", "A decode instance's KV memory for "
                  "new requests (when its capacity is known).", labels, rows("free_kv_bytes"))
        yield one(CounterMetricFamily, "upstream_errors", "Failures of the instance "
                  "(unreachable, timed out, 5xx).", labels, rows("upstream_errors"))


async def _body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(None, f"the body is not JSON: {e}") from e


def make_app(router: Router) -> FastAPI:
    """The router's FastAPI app (its lifespan starts and stops the router); serve it with
    `dualpath.http.server.HttpServer`, which adds the API key, the body limit and the
    timeouts."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="dualpath route", lifespan=lifespan)
    registry = CollectorRegistry()
    registry.register(_RouterCollector(router))
    add_error_handlers(app)

    async def passthrough(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, _Passthrough)
        return Response(exc.resp.content, status_code=exc.resp.status_code,
                        media_type=exc.resp.headers.get("content-type", "application/json"))

    app.add_exception_handler(_Passthrough, passthrough)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.handle(await _body(request), is_chat=False,
                                   trace_id=request.headers.get(REQUEST_ID_HEADER))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.handle(await _body(request), is_chat=True,
                                   trace_id=request.headers.get(REQUEST_ID_HEADER))

    @app.get("/v1/models")
    async def models() -> Response:
        return await router.models()

    @app.get("/health")
    async def health() -> Response:
        status, down = router.health()
        return JSONResponse({"status": status, "down": down},
                            status_code=HTTPStatus.SERVICE_UNAVAILABLE
                            if status == "unavailable" else HTTPStatus.OK)

    @app.get("/stats")
    async def stats() -> Response:
        return JSONResponse(router.stats())

    @app.get("/metrics")
    async def metrics() -> Response:
        return exposition.metrics_response(registry)

    return app

