"""The router's HTTP/1.1 client (`router.client.Pool`) against small asyncio servers on
loopback that answer, stall, close or cut a reply as a failing instance would."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest

from dualpath.integrations.vllm.router.client import (
    ConnectFailed,
    Disconnected,
    Pool,
    ReadTimeout,
    is_broken,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return await reader.readexactly(length) if length else b""


def run(handler: Handler, test: Callable[[Pool, list[int]], Awaitable[None]]) -> list[int]:
    """`test` against a server running `handler` per connection; returns how many
    connections the server accepted (one list entry each)."""
    accepted: list[int] = []

    async def main() -> None:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            accepted.append(1)
            try:
                await handler(r, w)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                w.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Pool(f"http://127.0.0.1:{port}", connect_timeout_s=2.0, read_timeout_s=0.5)
        async with server:
            await test(pool, accepted)
        pool.close()

    asyncio.run(main())
    return accepted


def reply(body: bytes, extra: str = "") -> bytes:
    return (f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def test_replies_keep_their_connection_and_bodies_arrive_whole() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            body = await read_request(r)
            w.write(reply(b'{"echo": ' + body + b"}"))

    async def test(pool: Pool, accepted: list[int]) -> None:
        for k in range(3):
            got = await pool.request("POST", "/x", b'"%d"' % k)
            assert got.status == 200 and got.json() == {"echo": str(k)}

    assert len(run(handler, test)) == 1


def test_a_chunked_stream_is_read_as_it_comes() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in (b"data: a\n\n", b"data: b\n\n"):
            w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await w.drain()
        w.write(b"0\r\n\r\n")
        await read_request(r)  # the connection goes back to the pool

    async def test(pool: Pool, accepted: list[int]) -> None:
        stream = await pool.stream("POST", "/s", b"{}")
        assert [p async for p in stream.chunks()] == [b"data: a\n\n", b"data: b\n\n"]
        await stream.aclose()

    run(handler, test)


def test_a_kept_alive_connection_closed_while_idle_is_replaced_once() -> None:
    # The server answers one request per connection; a second one on it crosses the
    # connection's close (the server closes as the request arrives, as a server closing an
    # idle kept-alive connection does): it goes out again on a new connection, unseen by
    # the caller.
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(reply(b"{}"))
        await w.drain()
        await r.read(1)  # the next request's first byte: close, unread

    async def test(pool: Pool, accepted: list[int]) -> None:
        for _ in range(3):
            assert (await pool.request("GET", "/h")).status == 200

    assert len(run(handler, test)) == 3


def test_failures_say_whether_the_instance_is_gone_or_slow() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        body = await read_request(r)
        if body == b"cut":
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
            await w.drain()
            return  # closed mid-body
        await asyncio.sleep(5)  # "slow": silent past the read timeout

    async def test(pool: Pool, accepted: list[int]) -> None:
        with pytest.raises(Disconnected) as cut:
            await pool.request("POST", "/x", b"cut")
        assert is_broken(cut.value)
        with pytest.raises(ReadTimeout) as slow:
            await pool.request("POST", "/x", b"slow")
        assert not is_broken(slow.value)

    run(handler, test)


def test_nothing_listening_is_a_broken_connect() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()

    async def main() -> None:
        pool = Pool(f"http://127.0.0.1:{port}", connect_timeout_s=2.0, read_timeout_s=1.0)
        with pytest.raises(ConnectFailed) as refused:
            await pool.request("GET", "/health")
        assert is_broken(refused.value)

    asyncio.run(main())
