"""`dualpath route`'s HTTP app: the router's endpoints and its lifecycle (`router.Router`
does the routing; `dualpath.http.server.HttpServer` serves the app)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry

from dualpath.http import exposition
from dualpath.http.api_error import add_error_handlers, bad_request
from dualpath.integrations.vllm.reports import REPORT_PATH
from dualpath.integrations.vllm.router.prometheus import RouterCollector
from dualpath.integrations.vllm.router.router import REQUEST_ID_HEADER, Router
from dualpath.integrations.vllm.router.upstream import Passthrough


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
    registry.register(RouterCollector(router))
    add_error_handlers(app)

    async def passthrough(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Passthrough)
        return Response(exc.reply.body, status_code=exc.reply.status,
                        media_type=exc.reply.content_type)

    app.add_exception_handler(Passthrough, passthrough)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.handle(await _body(request), is_chat=False,
                                   trace_id=request.headers.get(REQUEST_ID_HEADER))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.handle(await _body(request), is_chat=True,
                                   trace_id=request.headers.get(REQUEST_ID_HEADER))

    @app.post(REPORT_PATH)
    async def report(request: Request) -> Response:
        return JSONResponse(router.take_report(await request.body()))

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

