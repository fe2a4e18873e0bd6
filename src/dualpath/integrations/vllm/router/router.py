"""`dualpath route`'s router: an OpenAI-compatible router in front of P prefill and D decode
vLLM instances running `DualPathConnector`, deciding with the one `sched.scheduler.Scheduler`
(`policy.RoutePolicy`; this module moves the requests and nothing else decides).

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
   instance (`bodies`);
5. the client's original body plus the prefill reply's `kv_transfer_params` (none if it had
   none: the decode instance then recomputes) to the decode instance;
6. the decode instance's reply back to the client (SSE passed through when streaming), its
   usage filled in (`usage`).

Errors have OpenAI's shape: 400 for a bad body, 401 without the API key, 408 / 413 for a
body too slow or too large, 502 / 504 for an instance that fails or times out (`upstream`),
503 when no instance could take the request in time. The API key, the body's limits and the
connection timeouts are `dualpath.http`'s, the same as `dualpath serve`'s. Instances are
polled (`scrape`); one that fails is marked down and a request it failed is placed again
(`failover`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Any

from fastapi.responses import Response, StreamingResponse

from dualpath.core.blocks import NO_SCOPE, KeyScope
from dualpath.core.errors import SpecError
from dualpath.http.api_error import ApiError, bad_request, server_error
from dualpath.integrations.vllm.manifest import LoadReport, RouteParams
from dualpath.integrations.vllm.reports import NodeReport
from dualpath.integrations.vllm.router.bodies import (
    decode_body,
    gen_tokens,
    is_token_ids,
    prefill_body,
    tokenize_request,
)
from dualpath.integrations.vllm.router.client import Stream, UpstreamError, is_broken
from dualpath.integrations.vllm.router.config import RouterConfig
from dualpath.integrations.vllm.router.failover import (
    MAX_UNREACHED,
    RETRIES,
    Liveness,
    Retry,
)
from dualpath.integrations.vllm.router.intake import Intake
from dualpath.integrations.vllm.router.known import KnownBlocks
from dualpath.integrations.vllm.router.policy import Route, RoutePolicy
from dualpath.integrations.vllm.router.scope import ModelCatalog, body_scope
from dualpath.integrations.vllm.router.scrape import Poller
from dualpath.integrations.vllm.router.upstream import Upstream
from dualpath.integrations.vllm.router.usage import (
    DONE_EVENT,
    sse_events,
    usage_report,
    with_usage,
    with_usage_event,
)
from dualpath.sched.types import Role
from dualpath.store import BlockStore

log = logging.getLogger("dualpath.route")

STAT_THREADS = 32
"""Parallel store checks of one prompt's blocks (on NFS a `stat` is a round trip)."""
REQUEST_ID_HEADER = "X-Request-Id"
"""The trace id header (vLLM's convention: its request ids are built from it)."""


class Router:
    """The policy, the store, the HTTP client and the requests waiting for a placement."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        m = cfg.manifest
        self.policy = RoutePolicy(cfg.params, len(cfg.prefill), len(cfg.decode),
                                  cfg.is_round_robin, cfg.decode_kv_capacity_bytes,
                                  cfg.forced_read_side, cfg.layout)
        self.store = BlockStore(cfg.store, m.file_bytes, is_durable=False)
        self.known = KnownBlocks(self.store.contains)
        """The store's files known to exist (checks of an agent's repeated context skipped)."""
        self._ids = itertools.count(1)
        self._tokenize_turn = itertools.count()
        self._waiters: dict[int, asyncio.Future[Route]] = {}
        self.liveness = Liveness(cfg, self.policy, self._place)
        self.upstream = Upstream(cfg, self.liveness)
        self.intake = Intake(cfg, self.policy, self.liveness, self._place)
        """The nodes' pushed reports (the instances they cover are not polled)."""
        self.poller = Poller(cfg, self.policy, self.liveness, self.upstream.pool,
                             self._place, self.intake.is_covered)
        self.catalog = ModelCatalog(self._models, cfg.model_name)
        """The instances' models and adapters, for each request's key scope."""
        self.num_queue_timeouts = 0
        self.num_retries = 0
        self.loaded_blocks: Counter[str] = Counter()
        """Blocks the prefill connectors reported loaded, per read side, and "recomputed"."""
        self.num_stream_errors = 0
        """Streams that broke after their first event (ended with an error event)."""
        self.num_schedules = 0
        self.schedule_s = 0.0
        """Calls of the policy's `schedule` and the time spent in them."""
        self._tasks: list[asyncio.Task[None]] = []
        self._stat_threads = ThreadPoolExecutor(STAT_THREADS, thread_name_prefix="dualpath-stat")
        """Where a prompt's stored-prefix checks run, a wave at a time (`manifest.in_waves`)."""

    # -- life ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.upstream.start()
        self._tasks = [asyncio.create_task(self.poller.poll_forever()),
                       asyncio.create_task(self.intake.watch_forever())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.upstream.stop()
        self._stat_threads.shutdown(wait=False, cancel_futures=True)

    def health(self) -> tuple[str, list[dict[str, Any]]]:
        return self.liveness.health()

    def take_report(self, data: bytes) -> dict[str, Any]:
        """A node's pushed report (`reports.NodeReport` JSON); a malformed one is a 400."""
        try:
            report = NodeReport.from_json(data)
        except SpecError as e:
            raise bad_request(None, str(e)) from None
        return {"unknown": self.intake.take(report)}

    # -- placement -------------------------------------------------------------------------
    def _place(self) -> None:
        """Run the scheduler and wake the requests it placed."""
        began = time.perf_counter()
        routes = self.policy.schedule()
        self.schedule_s += time.perf_counter() - began
        self.num_schedules += 1
        for route in routes:
            fut = self._waiters.pop(route.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(route)

    async def _placed(self, request_id: int) -> Route:
        fut: asyncio.Future[Route] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = fut
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
            self._waiters.pop(request_id, None)

    def _release(self, request_id: int, is_ok: bool) -> None:
        if self.policy.is_known(request_id):
            if is_ok:
                self.policy.finished(request_id)
            else:
                self.policy.abort(request_id)
        self._place()

    # -- requests --------------------------------------------------------------------------
    async def tokens(self, body: dict[str, Any], is_chat: bool) -> list[int]:
        """The prompt's token ids (from a prefill instance's `/tokenize`, or the body's own)."""
        req = tokenize_request(body, is_chat, self.cfg.model)
        if isinstance(req, list):
            return req
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
            try:
                resp = await self.upstream.post(role, index, "/tokenize", req)
                break
            except ApiError:
                if k == len(candidates) - 1 or self.policy.is_up(role, index):
                    raise
        try:
            ids = resp.json()["tokens"]
        except (ValueError, KeyError, TypeError):
            ids = None
        if not is_token_ids(ids):
            self.upstream.count_error(role, index)
            raise server_error(HTTPStatus.BAD_GATEWAY, f"{role.value} instance "
                               f"{self.cfg.url_of(role, index)}/tokenize: no token ids in "
                               "its reply")
        return list(ids)

    def _tokenizers(self) -> list[tuple[Role, int]]:
        """The instances to ask for a prompt's tokens, in order: the prefill instances that
        are up, from the next in turn, then the decode instances that are up."""
        num = len(self.cfg.prefill)
        turn = next(self._tokenize_turn)
        prefill = [(Role.PREFILL, (turn + k) % num) for k in range(num)]
        decode = [(Role.DECODE, j) for j in range(len(self.cfg.decode))]
        return [(role, i) for role, i in prefill + decode if self.policy.is_up(role, i)]

    def hit_blocks(self, tokens: Sequence[int], scope: KeyScope | None = NO_SCOPE) -> int:
        """The prompt's stored prefix in whole blocks, as the connectors will find it within
        the request's key scope (None: a request they do not key counts none)."""
        if scope is None:
            return 0
        return self.cfg.manifest.hit_blocks(tokens, self.known.contains, self._stat_threads,
                                            scope)

    async def _models(self) -> Any:
        """A prefill instance's `/v1/models` (the catalog of base models and adapters)."""
        index = next(self._tokenize_turn) % len(self.cfg.prefill)
        reply = await self.upstream.pool(Role.PREFILL, index).request("GET", "/v1/models")
        if reply.status != HTTPStatus.OK:
            raise ValueError(f"/v1/models answered HTTP {reply.status}")
        return reply.json()

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
        gen = gen_tokens(body)
        trace_id = trace_id or uuid.uuid4().hex
        scope = await body_scope(body, is_chat, self.catalog)
        tokens = await self.tokens(body, is_chat)
        # On the event loop while the store answers fast (a local disk, most files known);
        # a slow one (a network file system's round trips) is asked from a thread.
        hit = await asyncio.to_thread(self.hit_blocks, tokens, scope) \
            if self.known.is_slow else self.hit_blocks(tokens, scope)
        request_id = next(self._ids)
        self.policy.submit(request_id, len(tokens), hit, gen)
        is_handed_off = is_ok = False
        try:
            num_failed = num_unreached = 0
            while True:
                try:
                    resp, is_handed_off = await self._attempt(request_id, body, is_chat,
                                                              is_stream, trace_id)
                except Retry as e:
                    if e.is_unreached and num_unreached < MAX_UNREACHED:
                        num_unreached += 1
                    elif num_failed < RETRIES:
                        num_failed += 1
                    else:
                        raise e.error from None
                    self.num_retries += 1
                    log.warning("request %s: %s; placed again", trace_id, e.error.message)
                    self.policy.requeue(request_id)
                    continue
                is_ok = not is_handed_off
                resp.headers[REQUEST_ID_HEADER] = trace_id
                return resp
        finally:
            if not is_handed_off:
                self._release(request_id, is_ok)

    async def _attempt(self, request_id: int, body: dict[str, Any], is_chat: bool,
                       is_stream: bool, trace_id: str) -> tuple[Response, bool]:
        """One placement of the request through a prefill and a decode instance: the
        response, and whether a stream took over the request's release. An instance that
        fails before anything reached the client raises `Retry`."""
        route = await self._placed(request_id)
        path = "/v1/chat/completions" if is_chat else "/v1/completions"
        headers = {REQUEST_ID_HEADER: trace_id}
        # A fresh transfer id and the decode instance of this placement: nothing of an
        # earlier attempt (slots staged or pushed on a failed instance) is ever read.
        params = RouteParams(xfer=uuid.uuid4().hex, de=self.cfg.sides[route.decode],
                             hit_blocks=route.plan.num_hit_blocks,
                             pe_blocks=route.plan.num_pe_blocks)
        pre = await self.upstream.post_or_retry(Role.PREFILL, route.prefill, path,
                                                prefill_body(body, is_chat, params), headers)
        self.policy.prefill_done(request_id)
        self._place()
        try:
            kv = pre.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            kv = None
        try:
            report = LoadReport.from_params(kv) if isinstance(kv, dict) else None
        except SpecError as e:
            log.warning("request %s: prefill instance %s: %s", trace_id,
                        self.cfg.prefill[route.prefill], e)
            report = None
        if report is not None:
            self.loaded_blocks.update(pe=report.pe_blocks, de=report.de_blocks,
                                      recomputed=report.recomputed_blocks)
        m = self.cfg.manifest
        cached, extension = usage_report(route, report, m.block_size, m.full_block_bytes)
        out = decode_body(body, kv)
        if not is_stream:
            resp = await self.upstream.post_or_retry(Role.DECODE, route.decode, path, out,
                                                     headers)
            content = resp.body
            try:
                reply = json.loads(content)
            except ValueError:
                reply = None
            if with_usage(reply, cached, extension):
                content = json.dumps(reply).encode()
            return Response(content, status_code=resp.status,
                            media_type=resp.content_type), False
        stream = await self.upstream.open_stream(route.decode, path, out, headers)
        events = sse_events(stream.chunks())
        try:
            first = await anext(events, b"")
        except UpstreamError as e:
            await stream.aclose()
            err = self.upstream.error(Role.DECODE, route.decode, path, e)
            if is_broken(e):
                raise Retry(err) from e
            raise err from e
        except BaseException:
            await stream.aclose()
            raise
        usage = (cached, extension)
        return StreamingResponse(self._relay(request_id, route.decode, path, stream, first,
                                             events, usage),
                                 media_type=stream.headers.get("content-type",
                                                               "text/event-stream")), True

    async def _relay(self, request_id: int, index: int, path: str, resp: Stream,
                     first: bytes, events: AsyncIterator[bytes],
                     usage: tuple[int, dict[str, Any]]) -> AsyncIterator[bytes]:
        """The decode instance's events to the client, whole, their usage (when the client
        asked for it) filled in; a stream that breaks ends with an error event and `[DONE]`
        (an event cut short is dropped, never half sent)."""
        is_ok = False
        try:
            if first:
                yield with_usage_event(first, *usage)
            async for event in events:
                yield with_usage_event(event, *usage)
            is_ok = True
        except UpstreamError as e:
            self.num_stream_errors += 1
            err = self.upstream.error(Role.DECODE, index, path, e)
            yield f"data: {json.dumps(err.body())}\n\n".encode() + DONE_EVENT
        finally:
            await resp.aclose()
            self._release(request_id, is_ok)

    async def models(self) -> Response:
        index = next((i for i in range(len(self.cfg.prefill))
                      if self.policy.is_up(Role.PREFILL, i)), 0)
        reply = await self.upstream.get(Role.PREFILL, index, "/v1/models")
        return Response(reply.body, status_code=reply.status, media_type=reply.content_type)

    # -- numbers ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """`/stats`: the policy's numbers with the instances' URLs and the error counts."""
        snap = self.policy.snapshot(self.cfg.manifest.full_block_bytes)
        for role, urls in (("prefill", self.cfg.prefill), ("decode", self.cfg.decode)):
            for inst, url in zip(snap[role], urls, strict=True):
                inst["url"] = url
                inst["upstream_errors"] = self.upstream.errors[(role, url)]
                inst["metrics_poll_errors"] = self.poller.errors[(role, url)]
                down = self.liveness.down.get((Role(role), inst["index"]))
                inst["down_reason"] = None if down is None else down.reason
        for inst, side in zip(snap["decode"], self.cfg.sides, strict=True):
            inst["side_channel"] = side
        snap["loaded_blocks_by_side"] = {s: self.loaded_blocks[s] for s in ("pe", "de")}
        snap["recomputed_blocks"] = self.loaded_blocks["recomputed"]
        snap.update(mode=self.cfg.mode, model=self.cfg.model_name, health=self.health()[0],
                    retries=self.num_retries, stream_errors=self.num_stream_errors,
                    queue_timeouts=self.num_queue_timeouts,
                    schedule_calls=self.num_schedules, schedule_seconds=self.schedule_s,
                    polls=self.poller.num_polls, reports=self.intake.num_reports,
                    reporting_instances=self.intake.num_covered,
                    store_checks=self.known.num_checks, store_checks_skipped=self.known.num_hits,
                    block_size=self.cfg.manifest.block_size,
                    full_block_bytes=self.cfg.manifest.full_block_bytes)
        return snap
