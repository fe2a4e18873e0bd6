"""One NIXL agent (UCX backend) of a process: its registered memory, its peers, and batches of
one-sided READs and WRITEs that are posted now and waited for later.

A batch is a list of `(local_address, remote_address, num_bytes)` inside memory the two agents
registered. `post` starts it and returns a `Pending`; `Pending.wait` polls it to the end, hard
for a moment and then gently, and gives up after a timeout. A caller that moves the same pages
again and again (the vLLM connector's per-layer pulls and pushes) prepares its descriptor
lists once (`prep`, NIXL's prepared lists) and names entries of them by index per batch
(`post_prepped`): no descriptor is built or checked per batch. The runtime's nodes (`runtime/
transfer.py`, one shared-memory segment each) and the vLLM connector's workers (paged KV
tensors, the decode node's staging buffer) use the same agent.

Memory is registered as NIXL's `DRAM` or `VRAM` (a CUDA tensor: on its own device), and each
descriptor of a batch carries the type and device of the region that holds it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from dualpath.transport.traffic_class import KVTrafficClass
from dualpath.transport.transfer_error import TransferError

Desc = tuple[int, int, int]
"""(local address, remote address, bytes)."""

WAIT_TIMEOUT_S = 20.0
"""How long `Pending.wait` waits for a batch by default before it fails."""

PROGRESS_DELAY_US = 1000
"""The longest the UCX progress thread sleeps between polls when nothing wakes it. NIXL's
Python wrapper sets 0, which makes that thread spin on a core of its own (86% of one of a
2-core machine's cores, taken from the engine next to it); with a delay it sleeps in `poll()`
on the UCX workers' event fds and wakes as soon as a transfer needs it."""

MEM_TYPES = ("DRAM", "VRAM")

Indices = npt.NDArray[np.integer[Any]]
"""Entries of a prepared list (`Prepped`)."""


def is_nixl_available() -> bool:
    """True when the `nixl` package is importable."""
    return importlib.util.find_spec("nixl") is not None


def agent_name(role: str) -> str:
    """A name no other agent has: `dualpath-<role>-<12 hex digits>`."""
    return f"dualpath-{role}-{uuid.uuid4().hex[:12]}"


def tensor_memory(tensor: Any) -> tuple[str, int]:
    """NIXL's memory type and device of a tensor's storage: `VRAM` on its CUDA device, else
    `DRAM` (device 0)."""
    if bool(getattr(tensor, "is_cuda", False)):
        index = tensor.device.index
        return "VRAM", int(index) if index is not None else 0
    return "DRAM", 0


@dataclass(frozen=True)
class Region:
    """Registered memory: `num_bytes` from `address`, of `mem_type` on `device`."""

    address: int
    num_bytes: int
    mem_type: str = "DRAM"
    device: int = 0

    def holds(self, address: int, num_bytes: int) -> bool:
        return self.address <= address and address + num_bytes <= self.address + self.num_bytes


@dataclass
class Pending:
    """A posted batch; `wait` returns its bytes or raises `TransferError`."""

    agent: NixlAgent
    handle: Any
    num_bytes: int
    peer: str
    op: str
    done: bool = False

    def wait(self, timeout_s: float = WAIT_TIMEOUT_S) -> int:
        """Poll the batch to its end; its handle is released whatever the outcome."""
        if self.done:
            return self.num_bytes
        nixl, lock = self.agent.agent, self.agent.lock
        deadline = time.monotonic() + timeout_s

        def state_now() -> str:
            with lock:
                try:
                    return str(nixl.check_xfer_state(self.handle))
                except Exception as e:  # NIXL's own error types
                    return f"{type(e).__name__}: {e}"

        try:
            state = state_now()
            spins = 0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"NIXL {self.op} with {self.peer}: no completion in "
                                        f"{timeout_s:g} s")
                # Poll hard for a moment, then gently: a waiting background load must not
                # take a core from the engine on a small machine.
                spins += 1
                time.sleep(0 if spins < 100 else 0.0005)
                state = state_now()
            if state != "DONE":
                raise TransferError(f"NIXL {self.op} with {self.peer} failed ({state})")
        finally:
            self.done = True
            with lock, contextlib.suppress(Exception):
                nixl.release_xfer_handle(self.handle)
        return self.num_bytes


@dataclass
class Prepped:
    """A descriptor list NIXL prepared once (`NixlAgent.prep`), every entry `entry_bytes`
    long: batches name its entries by index. `peer` is "" for this agent's own memory."""

    handle: Any
    peer: str
    num_entries: int
    entry_bytes: int
    mem_type: str


_config_lock = threading.Lock()


def _nixl_agent(name: str, progress_thread: bool, ucx_params: dict[str, str]) -> Any:
    """A `nixl_agent` with the UCX backend whose progress thread (if any) waits in `poll()`
    for up to `PROGRESS_DELAY_US` instead of spinning. The wrapper builds its own
    `nixlAgentConfig` with `pthrDelay = 0`; for the moment of construction it gets a config
    class that keeps the delay at `PROGRESS_DELAY_US` or more. `ucx_params`: the UCX
    backend's init parameters (the wrapper's config passes none of its own, so a backend
    with some is created after the agent)."""
    agent = _bare_agent(name, progress_thread, [] if ucx_params else ["UCX"])
    if ucx_params:
        agent.create_backend("UCX", ucx_params)
    return agent


def _bare_agent(name: str, progress_thread: bool, backends: list[str]) -> Any:
    from nixl import _api
    from nixl._api import nixl_agent, nixl_agent_config

    config = nixl_agent_config(enable_prog_thread=progress_thread, backends=backends)
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


class NixlAgent:
    """A NIXL agent over memory registered once; thread-safe (every agent call holds `lock`:
    an engine thread and background loads share the agent)."""

    def __init__(self, name: str, progress_thread: bool | None = None,
                 traffic_class: KVTrafficClass | None = None) -> None:
        """`progress_thread`: UCX progress in a thread of its own. The target of one-sided
        transfers needs it (a runtime node, the decode node's staging service); an initiator
        progresses in its own polls, and a progress thread there only takes a core (on 2
        cores it starved the vLLM worker around it). Default: env
        DUALPATH_NIXL_PROGRESS_THREAD=1, else off. `traffic_class`: the fabric class of this
        agent's transfers, set on its own UCX context (`traffic_class.py`; default: the
        fabric's default)."""
        if progress_thread is None:
            progress_thread = os.environ.get("DUALPATH_NIXL_PROGRESS_THREAD", "0") == "1"
        self.name = name
        self.traffic_class = traffic_class or KVTrafficClass()
        try:
            self.agent: Any = _nixl_agent(name, progress_thread,
                                          self.traffic_class.backend_params())
        except Exception as e:  # NIXL's own error types
            raise TransferError(f"NIXL agent {name}: no UCX backend ({type(e).__name__}: "
                                f"{e})") from None
        self.lock = threading.Lock()
        self._regions: list[Region] = []
        self._peers: set[str] = set()
        self._prepped: list[Prepped] = []

    def register(self, regions: Sequence[tuple[int, int]], mem_type: str = "DRAM",
                 device: int = 0) -> None:
        """Register `(address, bytes)` regions of `mem_type` (`DRAM` or `VRAM`) on `device`."""
        if mem_type not in MEM_TYPES:
            raise TransferError(f"NIXL memory type {mem_type!r}; valid: {', '.join(MEM_TYPES)}")
        if not regions:
            return
        with self.lock:
            self.agent.register_memory([(a, n, device, "") for a, n in regions], mem_type)
            self._regions.extend(Region(a, n, mem_type, device) for a, n in regions)

    def deregister(self, regions: Sequence[tuple[int, int]], mem_type: str = "DRAM",
                   device: int = 0) -> None:
        """Deregister `(address, bytes)` regions registered by `register` (their memory may
        then be freed); a region not registered is skipped."""
        with self.lock:
            for address, num_bytes in regions:
                region = Region(address, num_bytes, mem_type, device)
                if region not in self._regions:
                    continue
                try:
                    self.agent.deregister_memory(self.agent.get_reg_descs(
                        [(address, num_bytes, device, "")], mem_type))
                except Exception as e:  # NIXL's own error types
                    raise TransferError(f"NIXL cannot deregister [{address:#x}, +{num_bytes})"
                                        f" ({type(e).__name__}: {e})") from None
                self._regions.remove(region)

    def register_tensors(self, tensors: Iterable[Any]) -> None:
        """Register each tensor's bytes once (tensors sharing a storage address count once):
        a CUDA tensor as `VRAM` on its device, any other as `DRAM`."""
        seen: set[int] = set()
        groups: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for t in tensors:
            address = int(t.data_ptr())
            if address in seen:
                continue
            seen.add(address)
            groups.setdefault(tensor_memory(t), []).append(
                (address, int(t.numel()) * int(t.element_size())))
        for (mem_type, device), regions in groups.items():
            self.register(regions, mem_type, device)

    def backend_params(self) -> dict[str, str]:
        """The parameters NIXL holds for this agent's UCX backend (its `engine_config` carries
        the traffic class's UCX settings)."""
        with self.lock:
            return {str(k): str(v) for k, v in self.agent.get_backend_params("UCX").items()}

    def metadata(self) -> bytes:
        """What a peer needs to `connect` to this agent."""
        with self.lock:
            return bytes(self.agent.get_agent_metadata())

    def connect(self, metadata: bytes) -> str:
        """Add a peer from its metadata; returns its agent name (idempotent)."""
        with self.lock:
            try:
                added = self.agent.add_remote_agent(metadata)
            except Exception as e:
                raise TransferError(f"NIXL cannot add a peer agent ({type(e).__name__}: "
                                    f"{e})") from None
            name = added.decode() if isinstance(added, bytes) else str(added)
            self._peers.add(name)
        return name

    def _local(self, descs: Sequence[Desc]) -> tuple[str, list[tuple[int, int, int]]]:
        """The batch's local memory type and its `(address, bytes, device)` descriptors."""
        types: set[str] = set()
        out = []
        for lo, _, n in descs:
            region = next((r for r in self._regions if r.holds(lo, n)), None)
            if region is None:
                raise TransferError(f"local bytes [{lo:#x}, +{n}) are outside registered memory")
            types.add(region.mem_type)
            out.append((lo, n, region.device))
        if len(types) > 1:
            raise TransferError(f"a NIXL batch mixes local memory types {sorted(types)}")
        return types.pop(), out

    def post(self, op: str, peer: str, descs: Sequence[Desc], remote_mem_type: str = "DRAM",
             remote_device: int = 0) -> Pending | None:
        """Start a READ (peer -> local) or WRITE (local -> peer) batch; None when empty.
        The peer's bytes are of `remote_mem_type` on `remote_device`."""
        if not descs:
            return None
        if peer not in self._peers:
            raise TransferError(f"NIXL peer {peer} is not connected")
        mem_type, local_descs = self._local(descs)
        with self.lock:
            try:  # NIXL raises its own errors (bytes the peer did not register, ...)
                local = self.agent.get_xfer_descs(local_descs, mem_type)
                remote = self.agent.get_xfer_descs(
                    [(ro, n, remote_device) for _, ro, n in descs], remote_mem_type)
                handle = self.agent.initialize_xfer(op, local, remote, peer)
            except Exception as e:
                raise TransferError(f"NIXL {op} with {peer} could not start "
                                    f"({type(e).__name__}: {e})") from None
            return self._start(op, peer, handle, sum(n for _, _, n in descs))

    def _start(self, op: str, peer: str, handle: Any, num_bytes: int) -> Pending:
        """Post a created transfer (under `lock`); its handle is released if it fails."""
        try:
            state = self.agent.transfer(handle)
        except Exception as e:
            state = f"{type(e).__name__}: {e}"
        pending = Pending(self, handle, num_bytes, peer, op)
        if state not in ("PROC", "DONE"):
            pending.done = True
            with contextlib.suppress(Exception):
                self.agent.release_xfer_handle(handle)
            raise TransferError(f"NIXL {op} with {peer} could not start ({state})")
        return pending

    def prep(self, addresses: npt.NDArray[np.uint64], entry_bytes: int, peer: str = "",
             mem_type: str = "DRAM", device: int = 0) -> Prepped:
        """Prepare the descriptor list of `entry_bytes` at each of `addresses`: in this
        agent's registered memory (`peer` ""; memory type and devices from its regions), or
        in `peer`'s, of `mem_type` on `device`. Kept until `close`."""
        addresses = np.ascontiguousarray(addresses, dtype=np.uint64)
        devices = np.full(len(addresses), device, dtype=np.uint64)
        if not peer:
            mem_type = self._local_types(addresses, entry_bytes, devices)
        elif peer not in self._peers:
            raise TransferError(f"NIXL peer {peer} is not connected")
        if mem_type not in MEM_TYPES:
            raise TransferError(f"NIXL memory type {mem_type!r}; valid: {', '.join(MEM_TYPES)}")
        table = np.stack([addresses, np.full(len(addresses), entry_bytes, dtype=np.uint64),
                          devices], axis=1)
        with self.lock:
            try:
                handle = self.agent.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", table, mem_type)
            except Exception as e:  # NIXL's own errors (bytes the peer did not register)
                raise TransferError(f"NIXL cannot prepare {len(addresses)} descriptors "
                                    f"{'of ' + peer if peer else 'here'} "
                                    f"({type(e).__name__}: {e})") from None
            prepped = Prepped(handle, peer, len(addresses), entry_bytes, mem_type)
            self._prepped.append(prepped)
        return prepped

    def release(self, prepped: Prepped) -> None:
        """Release a list `prep` made (before the memory it names is deregistered)."""
        with self.lock:
            kept = [p for p in self._prepped if p is not prepped]
            if len(kept) < len(self._prepped):
                self._prepped = kept
                with contextlib.suppress(Exception):
                    self.agent.release_dlist_handle(prepped.handle)

    def _local_types(self, addresses: npt.NDArray[np.uint64], entry_bytes: int,
                     devices: npt.NDArray[np.uint64]) -> str:
        """The one memory type of `entry_bytes` at each of `addresses` (each inside one
        registered region); fills in each entry's device."""
        types: set[str] = set()
        inside = np.zeros(len(addresses), dtype=bool)
        for r in self._regions:
            here = (addresses >= r.address) & (addresses + entry_bytes <= r.address + r.num_bytes)
            if here.any():
                types.add(r.mem_type)
                devices[here] = r.device
                inside |= here
        if not inside.all():
            lo = int(addresses[~inside][0])
            raise TransferError(f"local bytes [{lo:#x}, +{entry_bytes}) are outside registered "
                                "memory")
        if len(types) > 1:
            raise TransferError(f"a NIXL list mixes local memory types {sorted(types)}")
        return types.pop() if types else "DRAM"

    def post_prepped(self, op: str, local: Prepped, local_indices: Indices, remote: Prepped,
                     remote_indices: Indices) -> Pending | None:
        """Start a READ (peer -> local) or WRITE (local -> peer) batch of the entries
        `local_indices[i]` <-> `remote_indices[i]` of two prepared lists; None when empty."""
        if len(local_indices) != len(remote_indices):
            raise TransferError(f"{len(local_indices)} local and {len(remote_indices)} remote "
                                "NIXL entries")
        if not len(local_indices):
            return None
        if local.entry_bytes != remote.entry_bytes:
            raise TransferError(f"NIXL entries of {local.entry_bytes} B here and "
                                f"{remote.entry_bytes} B at {remote.peer}")
        peer = remote.peer
        if peer not in self._peers:
            raise TransferError(f"NIXL peer {peer} is not connected")
        for side, indices in ((local, local_indices), (remote, remote_indices)):
            if int(indices.min()) < 0 or int(indices.max()) >= side.num_entries:
                raise TransferError(f"NIXL entries {int(indices.min())}..{int(indices.max())}"
                                    f" outside a list of {side.num_entries}")
        with self.lock:
            try:
                handle = self.agent.make_prepped_xfer(
                    op, local.handle, np.ascontiguousarray(local_indices, dtype=np.int32),
                    remote.handle, np.ascontiguousarray(remote_indices, dtype=np.int32))
            except Exception as e:
                raise TransferError(f"NIXL {op} with {peer} could not start "
                                    f"({type(e).__name__}: {e})") from None
            return self._start(op, peer, handle, len(local_indices) * local.entry_bytes)

    def transfer(self, op: str, peer: str, descs: Sequence[Desc],
                 timeout_s: float = WAIT_TIMEOUT_S) -> int:
        """`post` and wait for the batch; returns its bytes."""
        pending = self.post(op, peer, descs)
        return 0 if pending is None else pending.wait(timeout_s)

    def close(self) -> None:
        """Release the prepared lists and forget every peer (the registered memory goes
        with the agent)."""
        with self.lock:
            for prepped in self._prepped:
                with contextlib.suppress(Exception):
                    self.agent.release_dlist_handle(prepped.handle)
            self._prepped.clear()
            for name in self._peers:
                with contextlib.suppress(Exception):
                    self.agent.remove_remote_agent(name)
            self._peers.clear()
