"""`dualpath route`'s HTTP app: the router's endpoints and its lifecycle (`router.Router`
does the routing; `dualpath.http.server.HttpServer` serves the app)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from dualpath.http import exposition
from dualpath.http.api_error import ApiError, add_error_handlers, bad_request
from dualpath.http.guard import AsgiApp
from dualpath.integrations.vllm.reports import REPORT_PATH
from dualpath.integrations.vllm.router.prometheus import RouterCollector
from dualpath.integrations.vllm.router.router import REQUEST_ID_HEADER, Router
from dualpath.integrations.vllm.router.upstream import Passthrough


def make_app(router: Router) -> AsgiApp:
    """The router's app (its lifespan starts and stops the router); serve it with
    `dualpath.http.server.HttpServer`, which adds the API key, the body limit and the
    timeouts. The requests it routes and the nodes' reports go straight to the router
    (`fast_posts`); the rest through FastAPI's routing."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="dualpath route", lifespan=lifespan)
    registry = CollectorRegistry()
    registry.register(RouterCollector(router))
    add_error_handlers(app)

    async def passthrough(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Passthrough)
        return Response(exc.reply.body, status_code=exc.reply.status,
                        media_type=exc.reply.content_type)

    app.add_exception_handler(Passthrough, passthrough)

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

    return fast_posts(app, router)


def fast_posts(app: FastAPI, router: Router) -> AsgiApp:
    """`app`, with its hot POSTs (completions, chat, reports: every request and every node's
    report) answered without FastAPI's routing, dependency solving and exception middleware,
    a large part of the router's CPU per request; errors in the same shape."""
    chat, completions = "/v1/chat/completions", "/v1/completions"

    async def handle(request: Request) -> Response:
        path = request.url.path
        try:
            data = await request.body()
        except HTTPException as e:  # the guard's 408 / 413: the body is not read whole
            return ApiError(e.status_code, str(e.detail)).response(
                {**(e.headers or {}), "Connection": "close"})
        try:
            if path == REPORT_PATH:
                return JSONResponse(router.take_report(data))
            try:
                body = json.loads(data)
            except (ValueError, UnicodeDecodeError) as e:
                raise bad_request(None, f"the body is not JSON: {e}") from e
            return await router.handle(body, is_chat=path == chat,
                                       trace_id=request.headers.get(REQUEST_ID_HEADER))
        except ApiError as e:
            return e.response()
        except Passthrough as e:
            return Response(e.reply.body, status_code=e.reply.status,
                            media_type=e.reply.content_type)

    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and \
                scope["path"] in (completions, chat, REPORT_PATH):
            response = await handle(Request(scope, receive))
            await response(scope, receive, send)
            return
        await app(scope, receive, send)

    return asgi

