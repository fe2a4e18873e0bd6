"""A tiny app on the HTTP floor (`dualpath.http`), served on loopback as both front ends are."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from http import HTTPStatus
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from dualpath.http.api_error import ApiError, add_error_handlers, bad_request
from dualpath.http.server import HttpServer, ServerConfig

WAIT_S = 10.0


def echo_app(received: list[Any]) -> FastAPI:
    """POST /echo returns its JSON body (kept in `received`); /fail/{n} raises an ApiError;
    GET /health is open."""
    app = FastAPI()
    add_error_handlers(app)

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            raise bad_request(None, f"the body is not JSON: {e}") from None
        received.append(body)
        return JSONResponse({"echo": body})

    @app.get("/fail/{status}")
    async def fail(status: int) -> JSONResponse:
        if status == HTTPStatus.BAD_REQUEST:
            raise bad_request("field", "is wrong", code="bad_field")
        raise ApiError(status, f"failed with {status}", kind="server_error")

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    return app


def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)


Served = Callable[[ServerConfig], AbstractContextManager[tuple[HttpServer, list[Any]]]]


@contextmanager
def _served(config: ServerConfig) -> Iterator[tuple[HttpServer, list[Any]]]:
    received: list[Any] = []
    server = HttpServer(echo_app(received), "127.0.0.1", 0, config)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    wait_until(lambda: server.is_started)
    try:
        yield server, received
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture()
def served() -> Served:
    """`with served(config) as (server, received)`: `echo_app` on a free loopback port, in a
    thread; `received` holds the bodies its handler got."""
    return _served
