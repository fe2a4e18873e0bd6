"""The checks every request passes before the app sees it, as ASGI middleware: the API key,
the body size limit and the body deadline (`guarded`).

    401  without `Authorization: Bearer <key>` (when a key is set), on all but `OPEN_PATHS`
    413  a `Content-Length` over `max_body_bytes` (answered before a byte of the body is
         read), or a body without one that grows past it
    400  a `Content-Length` that is not a number
    408  a body that has not all arrived `body_timeout_s` after the head

Refusals close the connection, so the body the client may still be sending is never parsed
as a next request.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable, MutableMapping
from http import HTTPStatus
from typing import Any

from starlette.exceptions import HTTPException

from dualpath.http.api_error import ApiError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 16 * 2**20
OPEN_PATHS = ("/health", "/version", "/metrics", "/docs", "/openapi.json")
"""Paths served without the API key (as vLLM's)."""


def guarded(app: AsgiApp, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
            body_timeout_s: float = 30.0) -> AsgiApp:
    """`app` behind the API key (None: none), the body size limit and the body deadline.

    The limit and the deadline act inside the app's `receive`: what reads the body gets a
    Starlette `HTTPException` (408, 413), which `api_error.add_error_handlers` answers."""
    key = api_key.encode() if api_key else None

    async def guard(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        headers = dict(scope.get("headers") or ())

        async def refuse(err: ApiError, extra: dict[str, str] | None = None) -> None:
            await err.response({"Connection": "close", **(extra or {})})(scope, receive, send)

        path = str(scope.get("path", ""))
        if key is not None and not path.startswith(OPEN_PATHS):
            auth = headers.get(b"authorization", b"")
            if not hmac.compare_digest(auth, b"Bearer " + key):
                return await refuse(ApiError(HTTPStatus.UNAUTHORIZED, "a valid API key is "
                                             "needed: Authorization: Bearer <key>",
                                             code="invalid_api_key"),
                                    {"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            status = HTTPStatus.BAD_REQUEST if not length.isdigit() \
                else HTTPStatus.REQUEST_ENTITY_TOO_LARGE
            return await refuse(ApiError(status, f"Content-Length {length.decode()[:40]}: at "
                                         f"most {max_body_bytes} bytes are read"))
        deadline = time.monotonic() + body_timeout_s
        num_read = 0
        is_body_done = False

        async def limited() -> Message:
            nonlocal num_read, is_body_done
            if is_body_done:  # from here on only disconnects: no deadline
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise HTTPException(HTTPStatus.REQUEST_TIMEOUT, "the request body did not "
                                    f"arrive within {body_timeout_s:g} s") from None
            if msg["type"] == "http.request":
                num_read += len(msg.get("body", b""))
                if num_read > max_body_bytes:
                    raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                        f"request body over {max_body_bytes} bytes")
                is_body_done = not msg.get("more_body", False)
            return msg

        try:
            await app(scope, limited, send)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs after a graceful shutdown's grace period:
            # ending here keeps its "Exception in ASGI application" traceback off stderr.
            return None
        return None

    return guard
