"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every
HTTP front end (`dualpath serve`, `dualpath route`), and the FastAPI handlers that send them.

`ApiError` is raised anywhere below a route; `add_error_handlers` turns it, and Starlette's
own `HTTPException`s (404, 405, a body that is not JSON, the guard's 408 and 413), into that
shape. `code` is a short string (`"invalid_api_key"`) or null, as OpenAI's.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from dualpath.core.errors import DualPathError


class ApiError(DualPathError):
    """An HTTP error in OpenAI's shape; `param` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(param: str | None, why: str, code: str | None = None) -> ApiError:
    """A 400 naming the field `param` (its message starts with it), or the whole body (None)."""
    return ApiError(HTTPStatus.BAD_REQUEST, f"{param}: {why}" if param else why, param,
                    code=code)


def server_error(status: int, message: str) -> ApiError:
    """A failure on the server's side (503, 502, 504): type `server_error`."""
    return ApiError(status, message, kind="server_error")


def add_error_handlers(app: FastAPI) -> None:
    """`ApiError` and Starlette's `HTTPException` answered in OpenAI's shape on `app`.

    An error that may leave a request body unread closes the connection after it (the
    unread bytes must not be parsed as the next request); a 405 has no body to skip."""

    async def on_api_error(_r: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def on_http(r: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        message = str(exc.detail)
        if status == HTTPStatus.NOT_FOUND and message == "Not Found":
            message = f"no route {r.method} {r.url.path}"
        elif status == HTTPStatus.METHOD_NOT_ALLOWED:
            message = f"{r.method} is not allowed on {r.url.path}"
        elif status == HTTPStatus.BAD_REQUEST:
            message = f"invalid JSON body: {message}"
        headers = dict(exc.headers or {})
        if status >= 400 and status != HTTPStatus.METHOD_NOT_ALLOWED:
            headers.setdefault("Connection", "close")
        return ApiError(status, message).response(headers)

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(HTTPException, on_http)
