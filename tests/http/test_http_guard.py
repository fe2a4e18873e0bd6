"""The checks before the app (`dualpath.http.guard`), over real connections: the API key,
the body limit (413 before a byte is read, or once a body without a length grows past it),
a bad Content-Length, the body deadline (408)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx2

from dualpath.http.guard import MAX_BODY_BYTES, OPEN_PATHS
from dualpath.http.server import ServerConfig

if TYPE_CHECKING:
    from conftest import Served  # the fixture's type (tests/http/conftest.py)

KEY = "sk-floor"
WAIT_S = 10.0


def test_the_api_key_guards_all_but_the_open_paths(served: Served) -> None:
    assert "/health" in OPEN_PATHS and "/metrics" in OPEN_PATHS
    with served(ServerConfig(api_key=KEY, log_level="warning")) as (server, received), \
            httpx2.Client(base_url=server.url, timeout=WAIT_S) as client:
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = client.post("/echo", json={"a": 1}, headers=auth)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert received == []
        r = client.post("/echo", json={"a": 1}, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and received == [{"a": 1}]
        assert client.get("/health").status_code == 200


def test_a_body_over_the_limit_is_a_413_and_never_reaches_the_app(served: Served) -> None:
    limit = 1000
    with served(ServerConfig(max_body_bytes=limit, log_level="warning")) as (server, received), \
            httpx2.Client(base_url=server.url, timeout=WAIT_S) as client:
        body = b'{"x": "' + b"y" * limit + b'"}'
        r = client.post("/echo", content=body)  # its Content-Length says it is too large
        assert r.status_code == 413 and r.headers["connection"] == "close"
        assert r.json()["error"]["message"] == \
            f"Content-Length {len(body)}: at most {limit} bytes are read"

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it comes
            yield b'{"x": "'
            for _ in range(10):
                yield b"y" * 200
            yield b'"}'

        r = client.post("/echo", content=chunks())
        assert r.status_code == 413 and "over 1000 bytes" in r.json()["error"]["message"]
        assert received == []
        assert client.post("/echo", json={"x": "y" * (limit - 20)}).status_code == 200


def test_the_default_limit_refuses_50_mb_whole(served: Served) -> None:
    big = b'{"x": "' + b"y" * (50 * 2**20) + b'"}'
    with served(ServerConfig(log_level="warning")) as (server, received), \
            httpx2.Client(base_url=server.url, timeout=WAIT_S) as client:
        for _ in range(3):  # the refusal arrives whole every time (the close lingers)
            r = client.post("/echo", content=big)
            assert r.status_code == 413, r.text[:200]
            assert str(MAX_BODY_BYTES) in r.json()["error"]["message"]
        assert received == []


def test_a_bad_content_length_and_a_late_body(served: Served) -> None:
    with served(ServerConfig(body_timeout_s=0.3, log_level="warning")) as (server, _):
        port = server.server_address[1]
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as s:
            s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n")
            reply = _read_all(s)
            assert reply.startswith(b"HTTP/1.1 400") and b'"invalid_request_error"' in reply
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as s:
            s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{")
            reply = _read_all(s)  # the other 9 bytes never come
            assert reply.startswith(b"HTTP/1.1 408") and b"within 0.3 s" in reply


def _read_all(s: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_a_refused_body_can_still_be_sent_and_the_refusal_read_whole(served: Served) -> None:
    # Closing at once, with the body unread, would reset the connection: the client's next
    # send fails and the 413 not yet on the wire is lost. The server lingers instead.
    body = b"y" * (4 * 2**20)
    with served(ServerConfig(max_body_bytes=1000, log_level="warning")) as (server, _), \
            socket.create_connection(("127.0.0.1", server.server_address[1]),
                                     timeout=WAIT_S) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n")
        s.sendall(body)
        reply = _read_all(s)
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower()
    assert b"at most 1000 bytes are read" in payload and payload.endswith(b"}")
