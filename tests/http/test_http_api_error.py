"""OpenAI's error shape from `dualpath.http.api_error`: the errors, and the handlers answering
them and Starlette's own (404, 405, a body that is not JSON) on a served app."""

from __future__ import annotations

from http import HTTPStatus
from typing import TYPE_CHECKING

import httpx2

from dualpath.core.errors import DualPathError
from dualpath.http.api_error import ApiError, bad_request, server_error
from dualpath.http.server import ServerConfig

if TYPE_CHECKING:
    from conftest import Served  # the fixture's type (tests/http/conftest.py)

QUIET = ServerConfig(log_level="warning")


def test_bad_request_names_its_field_first() -> None:
    err = bad_request("messages[0].role", "must be user or assistant", code="bad_role")
    assert isinstance(err, DualPathError) and err.status == HTTPStatus.BAD_REQUEST
    assert err.body() == {"error": {"message": "messages[0].role: must be user or assistant",
                                    "type": "invalid_request_error",
                                    "param": "messages[0].role", "code": "bad_role"}}
    whole = bad_request(None, "the body must be a JSON object")
    assert whole.message == "the body must be a JSON object" and whole.param is None
    assert server_error(HTTPStatus.BAD_GATEWAY, "down").body()["error"]["type"] == \
        "server_error"


def test_errors_are_answered_in_openai_shape(served: Served) -> None:
    with served(QUIET) as (server, _), httpx2.Client(base_url=server.url) as client:
        r = client.get("/fail/400")
        assert r.status_code == 400
        assert r.json() == bad_request("field", "is wrong", code="bad_field").body()
        r = client.get("/fail/503")
        assert r.status_code == 503
        assert r.json() == ApiError(503, "failed with 503", kind="server_error").body()
        r = client.post("/nowhere", content=b'{"a": 1}')
        assert r.status_code == 404 and r.headers["connection"] == "close"  # body unread
        assert r.json()["error"]["message"] == "no route POST /nowhere"
        r = client.get("/echo")
        assert r.status_code == 405 and "connection" not in r.headers
        assert r.json()["error"]["message"] == "GET is not allowed on /echo"
        r = client.post("/echo", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["param"] is None
        assert client.post("/echo", json={"a": 1}).json() == {"echo": {"a": 1}}
