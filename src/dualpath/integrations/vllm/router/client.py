"""A lean HTTP/1.1 client to one instance: kept-alive connections on asyncio streams.

The router sends every request of every client through here (a prefill and a decode exchange
per request, the polls of instances that report nothing), so its cost per exchange bounds the
router's rate: this client parses a reply's head with one split and keeps no state beyond
its idle connections, for a small fraction of a general-purpose client's CPU time. It speaks
what vLLM's server speaks: `Content-Length` or chunked bodies, keep-alive, `Connection:
close`.

Failures are `UpstreamError`s; `is_broken` tells the ones that say the instance is gone
(refused, reset, dropped mid-reply, no connection in time) from a slow instance (`ReadTimeout`).
A kept-alive connection the instance closed while idle is found out when its reply has not
begun, and the request is sent again once on a new connection (the instance never read it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024
READ_BYTES = 256 * 1024
IDLE_S = 4.0
"""A connection idle longer is closed rather than used (servers close theirs after a few
seconds idle: uvicorn, vLLM's, after 5)."""
MAX_IDLE = 64
"""Idle connections kept per instance."""


class UpstreamError(Exception):
    """An exchange with an instance failed."""


class ConnectFailed(UpstreamError):
    """No connection: refused, unreachable, reset before the reply began."""


class ConnectTimeout(UpstreamError):
    """No connection within the connect timeout."""


class ReadTimeout(UpstreamError):
    """The instance took longer than the timeout to reply (or to send more of it)."""


class Disconnected(UpstreamError):
    """The connection closed or reset in the middle of the reply (`is_before_reply`: before
    any of it)."""

    def __init__(self, message: str, is_before_reply: bool = False) -> None:
        super().__init__(message)
        self.is_before_reply = is_before_reply


class BadReply(UpstreamError):
    """A reply that is not HTTP/1.1."""


def is_broken(exc: UpstreamError) -> bool:
    """Whether a failed exchange says the instance is gone, rather than slow."""
    return not isinstance(exc, ReadTimeout)


def is_unreached(exc: UpstreamError) -> bool:
    """Whether the request never got to the instance (no connection was made)."""
    return isinstance(exc, ConnectFailed | ConnectTimeout)


@dataclass(frozen=True)
class Reply:
    """A whole reply: its status, headers (names lowercased) and body."""

    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "application/json")

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)


class _Conn:
    __slots__ = ("idle_at", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_at = 0.0

    def close(self) -> None:
        self.writer.close()


class Stream:
    """A reply whose body is read as it comes (`chunks`); `aclose` when done with it."""

    def __init__(self, pool: Pool, conn: _Conn, status: int, headers: dict[str, str],
                 read_timeout_s: float) -> None:
        self._pool = pool
        self._conn: _Conn | None = conn
        self.status = status
        self.headers = headers
        self._timeout_s = read_timeout_s
        self._is_done = False

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "application/json")

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (a chunked body's chunks, decoded)."""
        conn = self._conn
        if conn is None:
            return
        async for piece in _body(conn.reader, self.headers, self._timeout_s):
            yield piece
        self._is_done = True

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.chunks()])

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._is_done and not _is_closing(self.headers):
            self._pool.release(conn)
        else:
            conn.close()


def _is_closing(headers: dict[str, str]) -> bool:
    return "close" in headers.get("connection", "").lower()


async def _read(coro: Any, timeout_s: float) -> Any:
    """`coro`'s result, with an instance that stops mid-reply or goes silent named."""
    try:
        async with asyncio.timeout(timeout_s):
            return await coro
    except TimeoutError:
        raise ReadTimeout(f"no reply within {timeout_s:g} s") from None
    except asyncio.IncompleteReadError as e:
        raise Disconnected(f"connection closed mid-reply ({len(e.partial)} bytes read)",
                           not e.partial) from None
    except asyncio.LimitOverrunError as e:
        raise BadReply(f"a reply head over {MAX_HEAD_BYTES} bytes") from e
    except (ConnectionError, OSError) as e:
        raise Disconnected(f"{type(e).__name__}: {e}", True) from None


async def _body(reader: asyncio.StreamReader, headers: dict[str, str],
                timeout_s: float) -> AsyncIterator[bytes]:
    """A reply's body from `reader`: by its length, chunked, or up to the connection's end."""
    if "chunked" in headers.get("transfer-encoding", ""):
        while True:
            line = await _read(reader.readuntil(b"\r\n"), timeout_s)
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise BadReply(f"a bad chunk size line {line[:40]!r}") from None
            if size == 0:
                while await _read(reader.readuntil(b"\r\n"), timeout_s) != b"\r\n":
                    pass  # trailers
                return
            data = await _read(reader.readexactly(size + 2), timeout_s)
            yield data[:-2]
    elif "content-length" in headers:
        try:
            left = int(headers["content-length"])
        except ValueError:
            raise BadReply(f"a bad Content-Length {headers['content-length']!r}") from None
        while left > 0:
            data = await _read(reader.read(min(left, READ_BYTES)), timeout_s)
            if not data:
                raise Disconnected(f"connection closed mid-reply ({left} bytes short)")
            left -= len(data)
            yield data
    else:
        while data := await _read(reader.read(READ_BYTES), timeout_s):
            yield data


class Pool:
    """One instance's kept-alive connections (`base_url`: `http://host:port`)."""

    def __init__(self, base_url: str, connect_timeout_s: float, read_timeout_s: float,
                 max_idle: int = MAX_IDLE) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"{base_url}: only http://host:port is supported")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.authority = parts.netloc
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_idle = max_idle
        self._idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    self.host, self.port, limit=MAX_HEAD_BYTES)
        except TimeoutError:
            raise ConnectTimeout(f"no connection within {self.connect_timeout_s:g} s") \
                from None
        except OSError as e:
            raise ConnectFailed(f"{type(e).__name__}: {e}") from None
        return _Conn(reader, writer)

    def _take(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_at < IDLE_S and not conn.writer.is_closing() \
                    and not conn.reader.at_eof():
                return conn
            conn.close()
        return None

    def release(self, conn: _Conn) -> None:
        if len(self._idle) >= self.max_idle or conn.writer.is_closing():
            conn.close()
            return
        conn.idle_at = time.monotonic()
        self._idle.append(conn)

    async def _send(self, method: str, path: str, body: bytes | None,
                    headers: dict[str, str] | None,
                    timeout_s: float) -> tuple[_Conn, int, dict[str, str]]:
        """Send the request and read the reply's head: (connection, status, headers)."""
        head = [f"{method} {path} HTTP/1.1\r\nHost: {self.authority}\r\n"]
        if body is not None:
            head.append(f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n")
        for name, value in (headers or {}).items():
            head.append(f"{name}: {value}\r\n")
        head.append("\r\n")
        data = "".join(head).encode("latin-1") + (body or b"")
        conn = self._take()
        is_reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect()
            try:
                conn.writer.write(data)
                raw = await _read(conn.reader.readuntil(b"\r\n\r\n"), timeout_s)
                break
            except Disconnected as e:
                conn.close()
                if not is_reused or not e.is_before_reply:
                    raise
                # A kept-alive connection the instance closed while idle: it never read the
                # request. Once more, on a new connection.
                conn, is_reused = None, False
            except BaseException:
                conn.close()
                raise
        try:
            status_line, *lines = raw.decode("latin-1").split("\r\n")
            status = int(status_line.split(" ", 2)[1])
        except (ValueError, IndexError):
            conn.close()
            raise BadReply(f"not an HTTP reply: {raw[:60]!r}") from None
        names: dict[str, str] = {}
        for line in lines:
            if line:
                name, _, value = line.partition(":")
                names[name.strip().lower()] = value.strip()
        return conn, status, names

    async def request(self, method: str, path: str, body: bytes | None = None,
                      headers: dict[str, str] | None = None,
                      timeout_s: float | None = None) -> Reply:
        """One exchange, its whole reply read (`timeout_s`: for each read; default the
        pool's read timeout)."""
        timeout_s = self.read_timeout_s if timeout_s is None else timeout_s
        conn, status, names = await self._send(method, path, body, headers, timeout_s)
        try:
            data = b"".join([p async for p in _body(conn.reader, names, timeout_s)])
        except BaseException:
            conn.close()
            raise
        if _is_closing(names) or ("content-length" not in names and \
                "chunked" not in names.get("transfer-encoding", "")):
            conn.close()
        else:
            self.release(conn)
        return Reply(status, names, data)

    async def stream(self, method: str, path: str, body: bytes | None = None,
                     headers: dict[str, str] | None = None) -> Stream:
        """One exchange whose reply's body is read as it comes (`Stream.chunks`)."""
        conn, status, names = await self._send(method, path, body, headers,
                                               self.read_timeout_s)
        return Stream(self, conn, status, names, self.read_timeout_s)

    def close(self) -> None:
        for conn in self._idle:
            with contextlib.suppress(RuntimeError):
                conn.close()
        self._idle.clear()
