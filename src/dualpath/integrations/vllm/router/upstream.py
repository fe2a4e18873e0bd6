"""The router's exchanges with its instances and what their failures become for the client.

Errors have OpenAI's shape: 502 for an instance that is unreachable or fails (5xx), 504 for
one that times out (both name the instance's URL); an instance's own 4xx is passed through
(`Passthrough`). An exchange that says the instance is gone (`failover.is_broken`) marks it
down; within a request's attempt it is a `failover.Retry`.
"""

from __future__ import annotations

from collections import Counter
from http import HTTPStatus
from typing import Any

import httpx2

from dualpath.http.api_error import ApiError, server_error
from dualpath.integrations.vllm.router.config import RouterConfig
from dualpath.integrations.vllm.router.failover import Liveness, Retry, is_broken
from dualpath.sched.types import Role


class Passthrough(Exception):
    """An instance's own 4xx reply, returned to the client unchanged."""

    def __init__(self, resp: httpx2.Response) -> None:
        super().__init__(resp.status_code)
        self.resp = resp


class Upstream:
    """The HTTP client to the instances and the count of their failures."""

    def __init__(self, cfg: RouterConfig, liveness: Liveness) -> None:
        self.cfg = cfg
        self.liveness = liveness
        self.errors: Counter[tuple[str, str]] = Counter()
        """(role, url) -> errors (unreachable, timeout, 5xx) of that instance."""
        self._client: httpx2.AsyncClient | None = None

    def start(self) -> None:
        timeout = httpx2.Timeout(self.cfg.upstream_timeout_s, connect=self.cfg.connect_timeout_s)
        limits = httpx2.Limits(max_connections=None, max_keepalive_connections=256)
        self._client = httpx2.AsyncClient(timeout=timeout, limits=limits)

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    @property
    def client(self) -> httpx2.AsyncClient:
        if self._client is None:
            raise RuntimeError("router not started")
        return self._client

    def count_error(self, role: Role, url: str) -> None:
        """One more failure of the instance `url` (an endpoint of it) belongs to."""
        urls = self.cfg.prefill if role is Role.PREFILL else self.cfg.decode
        base = next((u for u in urls if url == u or url.startswith(u + "/")), url)
        self.errors[(role.value, base)] += 1

    def error(self, role: Role, url: str, exc: httpx2.HTTPError,
              index: int | None = None) -> ApiError:
        """The client's error for a failed exchange with an instance; one that says the
        instance is gone (`is_broken`) marks it down (`index`: which one)."""
        self.count_error(role, url)
        if index is not None and is_broken(exc):
            self.liveness.mark_down(role, index, f"{type(exc).__name__}: {exc}"[:300])
        if isinstance(exc, httpx2.TimeoutException):
            return server_error(HTTPStatus.GATEWAY_TIMEOUT, f"{role.value} instance {url} "
                                f"timed out: {type(exc).__name__}")
        return server_error(HTTPStatus.BAD_GATEWAY, f"{role.value} instance {url} "
                            f"unreachable: {type(exc).__name__}: {exc}")

    def check_reply(self, role: Role, url: str, resp: httpx2.Response) -> None:
        """An instance's 4xx goes back to the client as it is; a 5xx is a 502."""
        if resp.status_code < 400:
            return
        if resp.status_code >= 500:
            self.count_error(role, url)
            raise server_error(HTTPStatus.BAD_GATEWAY, f"{role.value} instance {url} failed: "
                               f"HTTP {resp.status_code}: {resp.text[:500]}")
        raise Passthrough(resp)

    async def post(self, role: Role, url: str, body: dict[str, Any], index: int | None = None,
                   headers: dict[str, str] | None = None) -> httpx2.Response:
        try:
            resp = await self.client.post(url, json=body, headers=headers)
        except httpx2.HTTPError as e:
            raise self.error(role, url, e, index) from e
        self.check_reply(role, url, resp)
        return resp

    async def post_or_retry(self, role: Role, index: int, url: str, body: dict[str, Any],
                            headers: dict[str, str]) -> httpx2.Response:
        """`post` within a request's attempt: an instance gone or failing (5xx) is a
        `Retry`; a timeout is not (the client has waited long enough)."""
        try:
            resp = await self.client.post(url, json=body, headers=headers)
        except httpx2.HTTPError as e:
            err = self.error(role, url, e, index)
            if is_broken(e):
                raise Retry(err) from e
            raise err from e
        try:
            self.check_reply(role, url, resp)
        except ApiError as e:
            raise Retry(e) from e
        return resp

    async def open_stream(self, index: int, url: str, body: dict[str, Any],
                          headers: dict[str, str]) -> httpx2.Response:
        """A decode instance's streamed reply, opened; failures as `post_or_retry`'s."""
        request = self.client.build_request("POST", url, json=body, headers=headers)
        try:
            resp = await self.client.send(request, stream=True)
        except httpx2.HTTPError as e:
            err = self.error(Role.DECODE, url, e, index)
            if is_broken(e):
                raise Retry(err) from e
            raise err from e
        if resp.status_code >= 400:
            try:
                await resp.aread()
            finally:
                await resp.aclose()
            try:
                self.check_reply(Role.DECODE, url, resp)
            except ApiError as e:
                raise Retry(e) from e
        return resp
