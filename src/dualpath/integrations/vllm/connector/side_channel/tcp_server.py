"""`DecodeSideChannel`: the staging service's TCP server. Each connection is a stream of typed
requests (`messages.py`), answered in order; every request is logged with its time. A `stage`
reads its blocks `read_threads` at a time (a storage NIC needs many reads in flight; one after
another, each block's read and CRC32C check ran on one core)."""

from __future__ import annotations

import contextlib
import socketserver
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from dualpath.core.store import BlockStore
from dualpath.integrations.vllm.connector.side_channel.staging import StagingPool
from dualpath.integrations.vllm.connector.side_channel.wire import (
    Alloc,
    Commit,
    Done,
    Failed,
    Found,
    Hello,
    Lookup,
    Message,
    Release,
    Reply,
    SideChannelError,
    Slots,
    Stage,
    Staged,
    Welcome,
    decode,
    encode,
)
from dualpath.transport.pacing import Pacer


def split_address(address: str) -> tuple[str, int]:
    """`host:port` -> (host, port); an empty host is 127.0.0.1."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"side channel address {address!r} is not host:port")
    return host or "127.0.0.1", int(port)


class DecodeSideChannel:
    """The decode side's server around its `StagingPool` and `BlockStore`."""

    def __init__(self, address: str, pool: StagingPool, store: BlockStore,
                 agent_metadata: bytes, connect_peer: Callable[[bytes], str],
                 namespace: str = "", pacer: Pacer | None = None,
                 log: Callable[[dict[str, Any]], None] | None = None,
                 read_threads: int = 16) -> None:
        host, port = split_address(address)
        self.pool = pool
        self.store = store
        self.pacer = pacer
        """This decode node's emulated storage NIC (None: unpaced)."""
        self._welcome = Welcome(agent=agent_metadata, full_block_bytes=pool.full_block_bytes,
                                namespace=namespace, num_slots=pool.num_slots,
                                shm=pool.slots.name, address=pool.base)
        self._connect_peer = connect_peer
        self._readers = ThreadPoolExecutor(max(1, read_threads),
                                           thread_name_prefix="dualpath-stage")
        """Store reads of every connection's stages (one pool: the node's storage NIC)."""
        self._counts_lock = threading.Lock()
        self.num_staged_blocks = 0
        self.num_stage_errors = 0
        self._log = log
        self._peers: set[bytes] = set()
        self._peers_lock = threading.Lock()
        channel = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                for line in self.rfile:
                    t0 = time.monotonic()
                    msg: Message | None = None
                    try:
                        msg = decode(line)
                        reply = channel.serve(msg)
                    except Exception as e:  # the peer gets the reason
                        reply = Failed(f"{type(e).__name__}: {e}")
                    self.wfile.write(encode(reply))
                    self.wfile.flush()
                    if channel._log is not None:
                        channel._log(_record(msg, reply, time.monotonic() - t0))

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="dualpath-side-channel")
        self._thread.start()

    def serve(self, msg: Message) -> Reply:
        """The reply to one request."""
        if isinstance(msg, Hello):
            with self._peers_lock:  # a peer's agent is added once (NIXL keeps it)
                if msg.agent and msg.agent not in self._peers:
                    self._connect_peer(msg.agent)
                    self._peers.add(msg.agent)
            return self._welcome
        if isinstance(msg, Stage):
            return self._stage(msg.xfer, msg.first_block, msg.keys)
        if isinstance(msg, Alloc):
            slots = self.pool.alloc(msg.xfer, msg.blocks)
            return Slots(tuple(self.pool.address(s) for s in slots))
        if isinstance(msg, Commit):
            self.pool.commit(msg.xfer, dict(zip(msg.blocks, msg.crcs, strict=True)))
            return Done()
        if isinstance(msg, Lookup):  # the decode worker: which slots hold a request's blocks
            return Found(tuple(self.pool.lookup(msg.xfer, msg.blocks)),
                         tuple(self.pool.checksums(msg.xfer, msg.blocks)))
        if isinstance(msg, Release):  # the decode worker loaded them
            self.pool.release(msg.xfer)
            return Done()
        raise SideChannelError(f"{type(msg).__name__} is not a request")

    def _stage(self, xfer: str, first: int, keys: Sequence[bytes]) -> Staged:
        """Read `keys` into slots of `xfer` (blocks `first`..), in parallel; the reply holds
        the slots of the blocks before the first that failed (the prefill side recomputes
        from there on, so later blocks read meanwhile are not offered)."""
        blocks = list(range(first, first + len(keys)))
        slots = self.pool.alloc(xfer, blocks, is_read=True)

        def read(slot: int, key: bytes) -> tuple[bool, float]:
            with self.pacer.reading(self.store.full_block_bytes) if self.pacer is not None \
                    else contextlib.nullcontext():
                r0 = time.monotonic()
                return self.store.get_into(key, self.pool.slots.slot(slot)), \
                    time.monotonic() - r0

        ok = 0
        read_s = 0.0
        futures: list[Future[tuple[bool, float]]] = []
        try:
            futures += (self._readers.submit(read, slot, key)
                        for slot, key in zip(slots, keys, strict=True))
            done = [f.result() for f in futures]
            read_s = sum(s for _, s in done)
            ok = next((i for i, (is_read, _) in enumerate(done) if not is_read), len(done))
        finally:
            wait(futures)  # no read may write into a slot after the transfer lets it go
            self.pool.mark_staged(xfer, blocks[:ok])
        with self._counts_lock:
            self.num_staged_blocks += ok
            self.num_stage_errors += ok < len(keys)
        return Staged(tuple(self.pool.address(s) for s in slots[:ok]), round(read_s, 4))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._readers.shutdown(wait=True)


def _record(msg: Message | None, reply: Reply, seconds: float) -> dict[str, Any]:
    """The event-log record of one request (what `vllm_pd_bench` reads)."""
    ok: object = None
    if isinstance(reply, Staged):
        ok = len(reply.slots)
    elif isinstance(reply, Done):
        ok = True
    return {"event": "side_channel", "op": msg.op if msg is not None else None,
            "xfer": getattr(msg, "xfer", None),
            "error": reply.error if isinstance(reply, Failed) else None, "ok": ok,
            "read_s": reply.read_s if isinstance(reply, Staged) else None,
            "s": round(seconds, 4)}
