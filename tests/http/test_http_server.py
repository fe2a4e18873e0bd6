"""`dualpath.http.server`: the config's checks, the head deadline, idle kept-alive connections
closed, an unparseable request answered in OpenAI's shape, a stop that returns."""

from __future__ import annotations

import http.client
import json
import socket
from typing import TYPE_CHECKING, Any

import pytest

from dualpath.core.errors import SpecError
from dualpath.http.server import ServerConfig, bind

if TYPE_CHECKING:
    from conftest import Served  # the fixture's type (tests/http/conftest.py)

WAIT_S = 10.0


@pytest.mark.parametrize(("field", "value"), [
    ("backlog", 0), ("max_body_bytes", -1), ("keep_alive_s", 0.0), ("head_timeout_s", -1.0),
    ("body_timeout_s", float("nan")), ("log_level", "loud"),
])
def test_config_refuses_bad_values_by_name(field: str, value: Any) -> None:
    with pytest.raises(SpecError, match=f"server.{field}="):
        ServerConfig(**{field: value})


def test_bind_takes_any_free_port_and_says_which() -> None:
    with bind("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        assert port > 0
        with pytest.raises(OSError):
            bind("127.0.0.1", port).close()  # taken


def test_silent_and_slow_heads_and_idle_connections_are_closed(served: Served) -> None:
    cfg = ServerConfig(head_timeout_s=0.3, keep_alive_s=1.0, log_level="warning")
    with served(cfg) as (server, _):
        port = server.server_address[1]
        silent = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        slow = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never ends its head
        for s in (silent, slow):
            assert s.recv(4096) == b""  # closed by the server, not by our timeout
            s.close()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
        for _ in range(2):  # kept alive between requests...
            conn.request("GET", "/health")
            assert conn.getresponse().read() == b'{"status":"ok"}'
        first = conn.sock
        conn.request("GET", "/health")
        conn.getresponse().read()
        assert conn.sock is first
        assert conn.sock is not None and conn.sock.recv(1) == b""  # ...closed when idle
        conn.close()


def test_an_unparseable_request_gets_a_json_400(served: Served) -> None:
    with served(ServerConfig(log_level="warning")) as (server, _), \
            socket.create_connection(("127.0.0.1", server.server_address[1]),
                                     timeout=WAIT_S) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400")
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error"
    assert err["message"].startswith("invalid HTTP request")


def test_stop_returns_and_the_url_names_the_socket(served: Served) -> None:
    with served(ServerConfig(log_level="warning")) as (server, _):
        host, port = server.server_address
        assert server.url == f"http://{host}:{port}"
    with pytest.raises(OSError):
        socket.create_connection((host, port), timeout=WAIT_S).close()  # stopped, closed
