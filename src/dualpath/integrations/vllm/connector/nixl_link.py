"""One NIXL agent (UCX backend) of a vLLM worker: its registered memory, its peers, and batches
of one-sided READs and WRITEs that are posted now and waited for later.

A batch is a list of `(local_address, remote_address, num_bytes)` inside memory the two agents
registered (the prefill worker: every layer's paged KV tensor; the decode worker: its staging
buffer). `post` starts it and returns a `Pending`; `Pending.wait` polls it to the end (the
prefill side waits for layer `l`'s pulls just before layer `l` runs: the layerwise half of the
DE read path).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Desc = tuple[int, int, int]
"""(local address, remote address, bytes)."""


class LinkError(RuntimeError):
    """A NIXL transfer that failed or a peer that is not connected."""


@dataclass
class Pending:
    """A posted batch; `wait` returns its bytes or raises `LinkError`."""

    link: NixlLink
    handle: Any
    num_bytes: int
    peer: str
    op: str
    done: bool = False

    def wait(self, timeout_s: float = 20.0) -> int:
        if self.done:
            return self.num_bytes
        agent, lock = self.link.agent, self.link.lock
        deadline = time.monotonic() + timeout_s
        try:
            with lock:
                state = agent.check_xfer_state(self.handle)
            spins = 0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise LinkError(f"NIXL {self.op} with {self.peer}: no completion in "
                                    f"{timeout_s:.0f} s")
                # Poll hard for a moment, then gently: a waiting background load must not
                # take a core from the engine on a small machine.
                spins += 1
                time.sleep(0 if spins < 100 else 0.0005)
                with lock:
                    state = agent.check_xfer_state(self.handle)
            if state != "DONE":
                raise LinkError(f"NIXL {self.op} with {self.peer} failed ({state})")
        finally:
            self.done = True
            with lock, contextlib.suppress(Exception):
                agent.release_xfer_handle(self.handle)
        return self.num_bytes


PROGRESS_DELAY_US = 1000
"""The longest the UCX progress thread sleeps between polls when nothing wakes it. NIXL's
Python wrapper sets 0, which makes that thread spin on a core of its own (86% of one of
this machine's two cores, taken from the vLLM worker next to it); with a delay it sleeps in
`poll()` on the UCX workers' event fds and wakes as soon as a transfer needs it."""

_config_lock = threading.Lock()


def _nixl_agent(name: str, progress_thread: bool) -> Any:
    """A `nixl_agent` with the UCX backend whose progress thread (if any) waits in `poll()`
    for up to `PROGRESS_DELAY_US` instead of spinning. The wrapper builds its own
    `nixlAgentConfig` with `pthrDelay = 0`; for the moment of construction it gets a config
    class that keeps the delay at `PROGRESS_DELAY_US` or more."""
    from nixl import _api
    from nixl._api import nixl_agent, nixl_agent_config

    config = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    stock = getattr(_api.nixlBind, "nixlAgentConfig", None)
    delay = getattr(stock, "pthrDelay", None)
    if not progress_thread or stock is None or not isinstance(delay, property):
        return nixl_agent(name, config)
    get: Callable[[Any], Any] | None = delay.fget
    put: Callable[[Any, int], None] | None = delay.fset
    if get is None or put is None:
        return nixl_agent(name, config)
    getter, setter = get, put

    class _Config(stock):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # NIXL's name
            return int(getter(self))

        @pthrDelay.setter
        def pthrDelay(self, us: int) -> None:
            setter(self, max(int(us), PROGRESS_DELAY_US))

    with _config_lock:
        _api.nixlBind.nixlAgentConfig = _Config
        try:
            return nixl_agent(name, config)
        finally:
            _api.nixlBind.nixlAgentConfig = stock


class NixlLink:
    """A NIXL agent over DRAM regions registered once."""

    def __init__(self, role: str, progress_thread: bool | None = None) -> None:
        """`progress_thread`: UCX progress in a thread of its own. The target of one-sided
        transfers (the decode node's staging service) needs it; an initiator progresses in
        its own polls, and a progress thread there only takes a core (on 2 cores it starved
        the vLLM worker around it). Default: env DUALPATH_NIXL_PROGRESS_THREAD=1, else off."""
        self.name = f"dualpath-{role}-{uuid.uuid4().hex[:12]}"
        progress = progress_thread if progress_thread is not None else \
            os.environ.get("DUALPATH_NIXL_PROGRESS_THREAD", "0") == "1"
        self.agent: Any = _nixl_agent(self.name, progress)
        self._regions: list[tuple[int, int]] = []
        self._peers: dict[str, str] = {}
        self.lock = threading.Lock()
        """Every agent call holds it (the engine thread and the background loads share the
        agent)."""

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        """Register `(address, bytes)` regions of this process's DRAM."""
        self.agent.register_memory([(a, n, 0, "") for a, n in regions], "DRAM")
        self._regions.extend(regions)

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def connect(self, metadata: bytes) -> str:
        """Add a peer from its metadata; returns its agent name (idempotent)."""
        with self.lock:
            name = self.agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._peers[name] = name
        return name

    def _check_local(self, descs: Sequence[Desc]) -> None:
        for lo, _, n in descs:
            if not any(a <= lo and lo + n <= a + size for a, size in self._regions):
                raise LinkError(f"local bytes [{lo:#x}, +{n}) are outside registered memory")

    def post(self, op: str, peer: str, descs: Sequence[Desc]) -> Pending | None:
        """Start a READ (peer -> local) or WRITE (local -> peer) batch; None when empty."""
        if not descs:
            return None
        if peer not in self._peers:
            raise LinkError(f"NIXL peer {peer} is not connected")
        self._check_local(descs)
        with self.lock:
            local = self.agent.get_xfer_descs([(lo, n, 0) for lo, _, n in descs], "DRAM")
            remote = self.agent.get_xfer_descs([(ro, n, 0) for _, ro, n in descs], "DRAM")
            handle = self.agent.initialize_xfer(op, local, remote, peer)
            state = self.agent.transfer(handle)
            pending = Pending(self, handle, sum(n for _, _, n in descs), peer, op)
            if state not in ("PROC", "DONE"):
                pending.done = True
                with contextlib.suppress(Exception):
                    self.agent.release_xfer_handle(handle)
                raise LinkError(f"NIXL {op} with {peer} could not start ({state})")
        return pending

    def close(self) -> None:
        for name in list(self._peers):
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(name)
        self._peers.clear()
