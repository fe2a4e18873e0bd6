"""Engine-to-engine transfers behind one interface: NIXL (UCX, the transport's one agent,
`dualpath.transport.nixl`) when installed, else shared memory.

Each node registers one memory segment (its buffer pool, which also holds the engines' staging
slots) and publishes a `SegmentInfo` in a message; peers `connect` with it. A transfer is a batch
of `(local_offset, remote_offset, num_bytes)` descriptors posted at once (doorbell batching), as
an RDMA WRITE (push to the peer) or READ (pull from it). Pacing to the emulated NIC rates is not
done here: the caller charges the bytes to its ports with the traffic manager.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Protocol

from dualpath.transport.nixl import NixlAgent, is_nixl_available
from dualpath.transport.transfer_error import TransferError

Descriptor = tuple[int, int, int]
"""(local_offset, remote_offset, num_bytes) inside the two registered segments."""


@dataclass(frozen=True)
class SegmentInfo:
    """What a peer needs to address a node's segment; travels in a message."""

    node: int
    shm_name: str
    size_bytes: int
    agent_metadata: bytes = b""
    """NIXL agent metadata (empty for the shared-memory engine)."""
    base_address: int = 0
    """Virtual address of the segment in the owner process (NIXL descriptors use it)."""


class TransferEngine(Protocol):
    """Moves bytes between this node's segment and a peer's."""

    kind: str

    def local_info(self) -> SegmentInfo: ...

    def connect(self, peer: SegmentInfo) -> None: ...

    def write(self, peer: int, descs: Sequence[Descriptor]) -> int: ...

    def read(self, peer: int, descs: Sequence[Descriptor]) -> int: ...

    def close(self) -> None: ...


def _check(descs: Sequence[Descriptor], local_size: int, remote_size: int) -> int:
    total = 0
    for lo, ro, n in descs:
        if lo < 0 or ro < 0 or n < 0 or lo + n > local_size or ro + n > remote_size:
            raise TransferError(
                f"descriptor (local {lo}, remote {ro}, {n} bytes) outside segments of "
                f"{local_size} / {remote_size} bytes"
            )
        total += n
    return total


def attach_shm(name: str) -> shared_memory.SharedMemory:
    """Attach to a segment another node owns. Python 3.11 registers an attached segment with
    the resource tracker too; the nodes are all children (or threads) of one driver and share
    its tracker, whose registry is a set, so the owner's unlink clears the one entry."""
    return shared_memory.SharedMemory(name=name, create=False)


class ShmTransferEngine:
    """Fallback engine: peers' segments are mapped into this process and copied with memcpy."""

    kind = "shm"

    def __init__(self, node: int, shm_name: str, view: memoryview) -> None:
        self._info = SegmentInfo(node=node, shm_name=shm_name, size_bytes=view.nbytes)
        self._local = view
        self._peers: dict[int, tuple[shared_memory.SharedMemory, memoryview]] = {}

    def local_info(self) -> SegmentInfo:
        return self._info

    def connect(self, peer: SegmentInfo) -> None:
        if peer.node in self._peers or peer.node == self._info.node:
            return
        shm = attach_shm(peer.shm_name)
        self._peers[peer.node] = (shm, memoryview(shm.buf)[: peer.size_bytes])

    def _peer(self, peer: int) -> memoryview:
        if peer == self._info.node:
            return self._local
        try:
            return self._peers[peer][1]
        except KeyError:
            raise TransferError(f"node {peer} is not connected") from None

    def write(self, peer: int, descs: Sequence[Descriptor]) -> int:
        """Copy local bytes into the peer's segment; returns bytes moved."""
        remote = self._peer(peer)
        total = _check(descs, self._local.nbytes, remote.nbytes)
        for lo, ro, n in descs:
            remote[ro : ro + n] = self._local[lo : lo + n]
        return total

    def read(self, peer: int, descs: Sequence[Descriptor]) -> int:
        """Copy the peer's bytes into the local segment; returns bytes moved."""
        remote = self._peer(peer)
        total = _check(descs, self._local.nbytes, remote.nbytes)
        for lo, ro, n in descs:
            self._local[lo : lo + n] = remote[ro : ro + n]
        return total

    def close(self) -> None:
        for shm, view in self._peers.values():
            try:
                view.release()
                shm.close()
            except BufferError:
                pass
        self._peers.clear()


class NixlTransferEngine:
    """The transport's NIXL agent over the node's segment (registered as DRAM once, with a
    progress thread: every node is the target of its peers' one-sided transfers); a batch of
    descriptors is one transfer request, waited for with the agent's timeout."""

    kind = "nixl"

    def __init__(self, node: int, shm_name: str, view: memoryview, name_prefix: str = "") -> None:
        self._agent = NixlAgent(f"{name_prefix}node{node}", progress_thread=True)
        anchor = ctypes.c_char.from_buffer(view)
        self._base = ctypes.addressof(anchor)
        del anchor
        self._size = view.nbytes
        self._agent.register([(self._base, self._size)])
        self._info = SegmentInfo(
            node=node,
            shm_name=shm_name,
            size_bytes=self._size,
            agent_metadata=self._agent.metadata(),
            base_address=self._base,
        )
        self._peers: dict[int, tuple[str, int, int]] = {}

    def local_info(self) -> SegmentInfo:
        return self._info

    def connect(self, peer: SegmentInfo) -> None:
        if peer.node in self._peers or peer.node == self._info.node:
            return
        name = self._agent.connect(peer.agent_metadata)
        self._peers[peer.node] = (name, peer.base_address, peer.size_bytes)

    def _post(self, op: str, peer: int, descs: Sequence[Descriptor]) -> int:
        try:
            name, remote_base, remote_size = self._peers[peer]
        except KeyError:
            raise TransferError(f"node {peer} is not connected") from None
        total = _check(descs, self._size, remote_size)
        self._agent.transfer(
            op, name, [(self._base + lo, remote_base + ro, n) for lo, ro, n in descs]
        )
        return total

    def write(self, peer: int, descs: Sequence[Descriptor]) -> int:
        return self._post("WRITE", peer, descs)

    def read(self, peer: int, descs: Sequence[Descriptor]) -> int:
        return self._post("READ", peer, descs)

    def close(self) -> None:
        self._agent.close()
        self._peers.clear()


TRANSFER_KINDS = ("auto", "nixl", "shm")


def make_transfer_engine(
    kind: str, node: int, shm_name: str, view: memoryview, name_prefix: str = ""
) -> TransferEngine:
    """`auto`: NIXL when importable, else shared memory. Unknown kinds list the valid ones."""
    if kind not in TRANSFER_KINDS:
        raise TransferError(f"unknown transfer engine {kind!r}; valid: {', '.join(TRANSFER_KINDS)}")
    if kind == "nixl" or (kind == "auto" and is_nixl_available()):
        if not is_nixl_available():
            raise TransferError("transfer engine 'nixl' requested but nixl is not installed")
        return NixlTransferEngine(node, shm_name, view, name_prefix)
    return ShmTransferEngine(node, shm_name, view)
