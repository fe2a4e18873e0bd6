"""An ASGI app on a bound socket, served by uvicorn with every protection (`HttpServer`): the
API key, body limit and body deadline of `guard`, a deadline for each request's head, idle
kept-alive connections closed, unparseable requests answered in OpenAI's shape.

The caller owns the process's signals: `stop` (safe in a signal handler) ends `serve_forever`
(uvicorn's own Ctrl-C handling is off, so `dualpath serve` can stop its engine first).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Any, cast

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from dualpath.core.errors import SpecError
from dualpath.core.validate import positive, positive_int
from dualpath.http import LOG_LEVELS
from dualpath.http.api_error import bad_request
from dualpath.http.guard import MAX_BODY_BYTES, AsgiApp, guarded

GRACEFUL_SHUTDOWN_S = 5
"""What still runs this long after `stop` is cancelled."""
LINGER_S = 2.0
"""How long a connection closed with its request body still arriving keeps reading (and
dropping) it, unless the client closes first (`_LingeringTransport`)."""


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server treats connections and callers."""

    api_key: str | None = None
    """Callers must send `Authorization: Bearer <api_key>`; None: no key."""
    backlog: int = 2048
    """Connections the kernel queues before they are accepted."""
    keep_alive_s: float = 5.0
    """An idle kept-alive connection is closed after this (uvicorn: whole seconds, >= 1)."""
    head_timeout_s: float = 10.0
    """A request's head must arrive this soon after the connection opens or the previous
    response ends."""
    body_timeout_s: float = 30.0
    """A request's body must arrive this soon after its head."""
    max_body_bytes: int = MAX_BODY_BYTES
    log_level: str = "info"
    """uvicorn's; at info and debug each request is logged too."""

    def __post_init__(self) -> None:
        positive_int("server", "backlog", self.backlog)
        positive_int("server", "max_body_bytes", self.max_body_bytes)
        for name in ("keep_alive_s", "head_timeout_s", "body_timeout_s"):
            positive("server", name, getattr(self, name))
        if self.log_level not in LOG_LEVELS:
            raise SpecError("server", "log_level", self.log_level,
                            f"must be one of {', '.join(LOG_LEVELS)}")

    @property
    def is_access_log(self) -> bool:
        return self.log_level in ("info", "debug")


def bind(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on `host` (IPv4 or IPv6) and `port` (0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose protocol says TCP
    # (0 does not), and without it a kept-alive response's head and body, written apart,
    # wait for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


class _LingeringTransport:
    """A connection's transport whose `close`, while the client is still sending the
    request's body (a refused 50 MB upload), sends what is buffered and a FIN, then reads and
    drops the rest until the client closes or `LINGER_S` pass.

    Closing a socket with unread bytes makes the kernel send an RST and drop what it has not
    yet sent: the client would lose the very response (413, 401, 408) that refused its body.
    Everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, conn: h11.Connection,
                 loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._conn = conn
        self._loop = loop
        self._timer: asyncio.TimerHandle | None = None
        self.is_lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.is_lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.is_lingering or self._transport.is_closing() \
                or self._conn.their_state is not h11.SEND_BODY \
                or not self._transport.can_write_eof():
            self.abort_linger()
            self._transport.close()
            return
        self.is_lingering = True
        self._transport.write_eof()
        self._transport.resume_reading()
        self._timer = self._loop.call_later(LINGER_S, self._transport.close)

    def abort_linger(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _TimedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, plus a deadline for a request's head: a client that
    connects (or finishes a response) and then sends its headers slowly, or nothing, is cut
    at `head_timeout_s` (uvicorn alone waits for it forever); and a close that lingers while
    a refused body still arrives (`_LingeringTransport`)."""

    head_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._lingering = _LingeringTransport(transport, self.conn, self.loop)
        super().connection_made(cast(asyncio.Transport, self._lingering))
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if not self._lingering.is_lingering:  # else: the refused body, dropped
            super().data_received(data)

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._on_head_timeout)

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if (self.cycle is None or self.cycle.response_complete) \
                and not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before and self._head_timer is not None:
            self._head_timer.cancel()  # a whole head arrived
            self._head_timer = None

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (a bad Content-Length, a broken head): OpenAI's error
        shape too, not uvicorn's plain text."""
        body = json.dumps(bad_request(None, f"invalid HTTP request: {msg}").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        with contextlib.suppress(h11.LocalProtocolError):
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers,
                                                             reason=b"Bad Request")))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._lingering.abort_linger()
        super().connection_lost(exc)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield  # the caller owns the signals (module docstring)


class HttpServer:
    """`app`, guarded (`guard.guarded`), on a socket bound at construction; `serve_forever`
    runs uvicorn (with the app's lifespan) until `stop`."""

    def __init__(self, app: AsgiApp, host: str, port: int, config: ServerConfig) -> None:
        self.config = config
        self.socket = bind(host, port, config.backlog)
        self.server_address: tuple[str, int] = self.socket.getsockname()[:2]
        self.app = guarded(app, config.api_key, config.max_body_bytes, config.body_timeout_s)
        protocol = type("TimedH11", (_TimedH11,), {"head_timeout_s": config.head_timeout_s})
        logging.getLogger("uvicorn.error").propagate = False
        self._uvicorn = _Server(uvicorn.Config(
            self.app, http=protocol, backlog=config.backlog, lifespan="on",
            timeout_keep_alive=max(1, round(config.keep_alive_s)),
            log_level=config.log_level, access_log=config.is_access_log,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        ))
        self._stopped = threading.Event()

    @property
    def url(self) -> str:
        """`http://host:port` of the bound socket."""
        host, port = self.server_address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def is_started(self) -> bool:
        """uvicorn serves (the app's lifespan has started)."""
        return bool(self._uvicorn.started)

    def serve_forever(self) -> None:
        try:
            self._uvicorn.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def stop(self) -> None:
        """Ask `serve_forever` to return (safe in a signal handler)."""
        self._uvicorn.should_exit = True

    def shutdown(self) -> None:
        """Stop and wait for `serve_forever` to return."""
        self.stop()
        self._stopped.wait(30)

    def server_close(self) -> None:
        self.socket.close()
