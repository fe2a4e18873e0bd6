"""A worker's end of the side channel: `SideChannelClient` (typed requests over one TCP
connection) and `RemotePool` (the decode worker's view of the staging service's buffer)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import TypeVar

import torch

from dualpath.integrations.vllm.connector.side_channel.auth import proof
from dualpath.integrations.vllm.connector.side_channel.tcp_server import split_address
from dualpath.integrations.vllm.connector.side_channel.wire import (
    Alloc,
    Auth,
    Challenge,
    Commit,
    Done,
    Found,
    Hello,
    Lookup,
    Release,
    Reply,
    Request,
    SideChannelError,
    Slots,
    Stage,
    Staged,
    Welcome,
    decode,
    encode,
    expect,
)
from dualpath.transport.slots import SlotPool

R = TypeVar("R", bound=Reply)


class SideChannelClient:
    """A worker's connection to one decode instance's side channel (thread-safe)."""

    def __init__(self, address: str, timeout_s: float = 60.0, secret: bytes | None = None
                 ) -> None:
        """Connect and, where the service requires it, prove `secret` (the cluster's shared
        secret, `auth.load_secret`); a service that refuses it is a `SideChannelError`."""
        self.address = address
        self._sock = socket.create_connection(split_address(address), timeout=timeout_s)
        self._rfile = self._sock.makefile("rb")
        self._lock = threading.Lock()
        try:
            challenge = self.receive(Challenge)
            if challenge.is_required:
                if secret is None:
                    raise SideChannelError(
                        f"side channel {address} requires the cluster's shared secret; set "
                        "kv_connector_extra_config side_channel_secret or "
                        "$DUALPATH_SIDE_CHANNEL_SECRET")
                self.call(Auth(proof(secret, challenge.nonce)), Done)
        except BaseException:
            self.close()
            raise

    def call(self, msg: Request, reply: type[R]) -> R:
        """Send `msg` and wait for its reply, a `reply` (else a `SideChannelError`)."""
        with self._lock:
            self.send(msg)
            return self.receive(reply)

    def send(self, msg: Request) -> None:
        """Send a request without waiting (`receive` gets the replies in order); the caller
        owns the connection meanwhile."""
        try:
            self._sock.sendall(encode(msg))
        except OSError as e:
            raise SideChannelError(f"side channel {self.address}: {e}") from e

    def receive(self, reply: type[R]) -> R:
        """The reply to the oldest request not yet answered, a `reply`."""
        try:
            line = self._rfile.readline()
        except OSError as e:
            raise SideChannelError(f"side channel {self.address}: {e}") from e
        if not line:
            raise SideChannelError(f"side channel {self.address} closed the connection")
        return expect(decode(line), reply, self.address)

    def hello(self, agent_metadata: bytes = b"") -> Welcome:
        """Exchange agents (empty: only read the decode side's info)."""
        return self.call(Hello(agent_metadata), Welcome)

    def stage(self, xfer: str, first_block: int, keys: Sequence[bytes],
              num_blocks: int = 0) -> Staged:
        return self.call(Stage(xfer, first_block, tuple(keys), num_blocks), Staged)

    def alloc(self, xfer: str, blocks: Sequence[int]) -> tuple[int, ...]:
        """Slot addresses for `blocks` of `xfer`."""
        return self.call(Alloc(xfer, tuple(blocks)), Slots).slots

    def commit(self, xfer: str, crcs: Mapping[int, int] | None = None) -> None:
        """`crcs`: block index -> the digest of the Full Block written into its slot
        (`connector.digest`)."""
        blocks = tuple(crcs or ())
        self.call(Commit(xfer, blocks, tuple((crcs or {})[b] for b in blocks)), Done)

    def lookup(self, xfer: str, blocks: Sequence[int]) -> list[int | None]:
        return list(self.find(xfer, blocks).slots)

    def find(self, xfer: str, blocks: Sequence[int]) -> Found:
        """`lookup` with the writers' CRC32Cs."""
        return self.call(Lookup(xfer, tuple(blocks)), Found)

    def release(self, xfer: str) -> None:
        self.call(Release(xfer), Done)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._rfile.close()
            self._sock.close()


class RemotePool:
    """The decode worker's view of a staging service's buffer: slots found and released over
    the side channel, their bytes read from the shared memory both processes map."""

    def __init__(self, client: SideChannelClient, welcome: Welcome) -> None:
        self.client = client
        self.num_slots = welcome.num_slots
        self.full_block_bytes = welcome.full_block_bytes
        self._slots = SlotPool(welcome.shm, welcome.full_block_bytes, welcome.num_slots,
                               create=False)
        # Both processes map it now: its name is no longer needed, and unlinking it here means
        # no segment outlives them, however they end (the memory goes with the last mapping).
        self._slots.unlink()
        self._buffer = torch.frombuffer(self._slots.view, dtype=torch.uint8)
        self._crcs: dict[str, dict[int, int | None]] = {}

    def lookup(self, xfer: str, blocks: Sequence[int]) -> list[int | None]:
        found = self.client.find(xfer, blocks)
        self._crcs[xfer] = dict(zip(blocks, found.crcs, strict=False))
        return list(found.slots)

    def checksums(self, xfer: str, blocks: Sequence[int]) -> list[int | None]:
        """The CRC32Cs the last `lookup` of `xfer` returned (None: none given)."""
        known = self._crcs.get(xfer, {})
        return [known.get(b) for b in blocks]

    def view(self, slot: int) -> torch.Tensor:
        lo = slot * self.full_block_bytes
        return self._buffer[lo:lo + self.full_block_bytes]

    def release(self, xfer: str) -> None:
        self._crcs.pop(xfer, None)
        self.client.release(xfer)

    def close(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._slots.close()
