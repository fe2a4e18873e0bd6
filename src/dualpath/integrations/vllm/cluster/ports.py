"""Ports for servers on this machine: free now, and not among those already handed out to
servers that have not bound them yet."""

from __future__ import annotations

import contextlib
import socket


def free_port(taken: set[int] | None = None) -> int:
    """A port free on 127.0.0.1 now and not in `taken` (ports handed out for servers that
    have not bound them yet: the kernel would hand one of them out again); added to it."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if taken is None or port not in taken:
            if taken is not None:
                taken.add(port)
            return port
    raise OSError("no free port outside those already handed out")


def free_ports(n: int, taken: set[int] | None = None) -> int:
    """The first of `n` consecutive ports free on 127.0.0.1 now and not in `taken`
    (added to it)."""
    for _ in range(100):
        base = free_port()
        if base + n > 65536:
            continue
        if taken is not None and taken.intersection(range(base, base + n)):
            continue
        with contextlib.ExitStack() as held:
            try:
                for port in range(base + 1, base + n):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
            if taken is not None:
                taken.update(range(base, base + n))
            return base
    raise OSError(f"no {n} consecutive free ports")
