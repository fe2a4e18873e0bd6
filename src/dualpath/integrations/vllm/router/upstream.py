"""The router's exchanges with its instances and what their failures become for the client.

Errors have OpenAI's shape: 502 for an instance that is unreachable or fails (5xx), 504 for
one that times out (both name the instance's URL); an instance's own 4xx is passed through
(`Passthrough`). An exchange that says the instance is gone (`client.is_broken`) marks it
down; within a request's attempt it is a `failover.Retry`.
"""

from __future__ import annotations

import json
from collections import Counter
from http import HTTPStatus
from typing import Any

from dualpath.http.api_error import ApiError, server_error
from dualpath.integrations.vllm.router.client import (
    Pool,
    ReadTimeout,
    Reply,
    Stream,
    UpstreamError,
    is_broken,
    is_unreached,
)
from dualpath.integrations.vllm.router.config import RouterConfig
from dualpath.integrations.vllm.router.failover import Liveness, Retry
from dualpath.sched.types import Role


class Passthrough(Exception):
    """An instance's own 4xx reply, returned to the client unchanged."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.status)
        self.reply = reply


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


class Upstream:
    """The connections to the instances (one `client.Pool` each) and the count of their
    failures."""

    def __init__(self, cfg: RouterConfig, liveness: Liveness) -> None:
        self.cfg = cfg
        self.liveness = liveness
        self.errors: Counter[tuple[str, str]] = Counter()
        """(role, url) -> errors (unreachable, timeout, 5xx) of that instance."""
        self._pools: dict[tuple[Role, int], Pool] = {}
        self._is_started = False

    def start(self) -> None:
        self._is_started = True

    async def stop(self) -> None:
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.close()

    def pool(self, role: Role, index: int) -> Pool:
        """Instance `index` of `role`'s connections (made on first use)."""
        pool = self._pools.get((role, index))
        if pool is None:
            if not self._is_started:
                raise RuntimeError("router not started")
            pool = self._pools[(role, index)] = Pool(
                self.cfg.url_of(role, index), self.cfg.connect_timeout_s,
                self.cfg.upstream_timeout_s)
        return pool

    def count_error(self, role: Role, index: int) -> None:
        """One more failure of instance `index` of `role`."""
        self.errors[(role.value, self.cfg.url_of(role, index))] += 1

    def error(self, role: Role, index: int, path: str, exc: UpstreamError) -> ApiError:
        """The client's error for a failed exchange with an instance; one that says the
        instance is gone (`is_broken`) marks it down."""
        self.count_error(role, index)
        url = self.cfg.url_of(role, index) + path
        if is_broken(exc):
            self.liveness.mark_down(role, index, f"{type(exc).__name__}: {exc}"[:300])
        if isinstance(exc, ReadTimeout):
            return server_error(HTTPStatus.GATEWAY_TIMEOUT, f"{role.value} instance {url} "
                                f"timed out: {exc}")
        return server_error(HTTPStatus.BAD_GATEWAY, f"{role.value} instance {url} "
                            f"unreachable: {type(exc).__name__}: {exc}")

    def check_reply(self, role: Role, index: int, path: str, reply: Reply) -> None:
        """An instance's 4xx goes back to the client as it is; a 5xx is a 502."""
        if reply.status < 400:
            return
        if reply.status >= 500:
            self.count_error(role, index)
            raise server_error(HTTPStatus.BAD_GATEWAY, f"{role.value} instance "
                               f"{self.cfg.url_of(role, index)}{path} failed: "
                               f"HTTP {reply.status}: {reply.text[:500]}")
        raise Passthrough(reply)

    async def get(self, role: Role, index: int, path: str) -> Reply:
        try:
            reply = await self.pool(role, index).request("GET", path)
        except UpstreamError as e:
            raise self.error(role, index, path, e) from e
        self.check_reply(role, index, path, reply)
        return reply

    async def post(self, role: Role, index: int, path: str, body: dict[str, Any],
                   headers: dict[str, str] | None = None) -> Reply:
        try:
            reply = await self.pool(role, index).request("POST", path, encode(body), headers)
        except UpstreamError as e:
            raise self.error(role, index, path, e) from e
        self.check_reply(role, index, path, reply)
        return reply

    async def post_or_retry(self, role: Role, index: int, path: str, body: dict[str, Any],
                            headers: dict[str, str]) -> Reply:
        """`post` within a request's attempt: an instance gone or failing (5xx) is a
        `Retry`; a timeout is not (the client has waited long enough)."""
        try:
            reply = await self.pool(role, index).request("POST", path, encode(body), headers)
        except UpstreamError as e:
            err = self.error(role, index, path, e)
            if is_broken(e):
                raise Retry(err, is_unreached(e)) from e
            raise err from e
        try:
            self.check_reply(role, index, path, reply)
        except ApiError as e:
            raise Retry(e) from e
        return reply

    async def open_stream(self, index: int, path: str, body: dict[str, Any],
                          headers: dict[str, str]) -> Stream:
        """A decode instance's streamed reply, opened; failures as `post_or_retry`'s."""
        try:
            stream = await self.pool(Role.DECODE, index).stream("POST", path, encode(body),
                                                               headers)
        except UpstreamError as e:
            err = self.error(Role.DECODE, index, path, e)
            if is_broken(e):
                raise Retry(err, is_unreached(e)) from e
            raise err from e
        if stream.status >= 400:
            try:
                data = await stream.read()
            except UpstreamError:
                data = b""
            finally:
                await stream.aclose()
            try:
                self.check_reply(Role.DECODE, index, path,
                                 Reply(stream.status, stream.headers, data))
            except ApiError as e:
                raise Retry(e) from e
        return stream
