"""`DecodeSideChannel`: the staging service's TCP server. Each connection opens with a
`Challenge`; with a shared secret configured, a peer must answer it with `Auth` before
anything else (`auth`), and one that does not is refused, logged and cut off. Then the
connection is a stream of typed requests (`wire`), answered in order; every request is logged
with its time. A `stage` reads its blocks `read_threads` at a time (a storage NIC needs many
reads in flight; one after another, each block's read and CRC32C check would use one core).

Without a secret, the service only binds a loopback address (a single-host cluster); any other
address needs one."""

from __future__ import annotations

import contextlib
import logging
import os
import socketserver
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from dualpath.integrations.vllm.connector.side_channel.auth import is_loopback, is_valid
from dualpath.integrations.vllm.connector.side_channel.staging import StagingPool
from dualpath.integrations.vllm.connector.side_channel.wire import (
    Alloc,
    Auth,
    Challenge,
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
from dualpath.store import BlockStore
from dualpath.transport.pacing import Pacer

logger = logging.getLogger("dualpath.side_channel")
NONCE_BYTES = 32


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
                 read_threads: int = 16, secret: bytes | None = None) -> None:
        """`secret`: the cluster's shared secret (`auth.load_secret`); None serves any peer,
        on a loopback address only."""
        host, port = split_address(address)
        if secret is None and not is_loopback(host):
            raise SideChannelError(
                f"side channel {address}: a non-loopback address needs the cluster's shared "
                "secret (kv_connector_extra_config side_channel_secret, or "
                "$DUALPATH_SIDE_CHANNEL_SECRET); `dualpath vllm up` makes one per cluster")
        self._secret = secret
        self.num_refused = 0
        """Connections refused for a missing or wrong proof of the secret."""
        self.blocks_per_file, rest = divmod(store.full_block_bytes, pool.full_block_bytes)
        """g: blocks (staging slots) per store file."""
        if rest or not self.blocks_per_file:
            raise ValueError(f"store files of {store.full_block_bytes} B are not whole "
                             f"staging slots of {pool.full_block_bytes} B")
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
                nonce = os.urandom(NONCE_BYTES)
                is_authed = channel._secret is None
                self.wfile.write(encode(Challenge(nonce, not is_authed)))
                self.wfile.flush()
                for line in self.rfile:
                    t0 = time.monotonic()
                    msg: Message | None = None
                    try:
                        msg = decode(line)
                        if not is_authed:
                            is_authed = channel._check_proof(msg, nonce)
                            if not is_authed:
                                self.wfile.write(encode(channel._refuse(
                                    msg, self.client_address)))
                                return  # no slot, no data: the connection ends here
                            reply: Reply = Done()
                        else:
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

    def _check_proof(self, msg: Message, nonce: bytes) -> bool:
        """Whether `msg`, a connection's first request, proves the secret for `nonce`."""
        assert self._secret is not None
        return isinstance(msg, Auth) and is_valid(self._secret, nonce, msg.mac)

    def _refuse(self, msg: Message, peer: Any) -> Failed:
        """Count, log and answer a peer that did not prove the secret."""
        why = "wrong proof of the shared secret" if isinstance(msg, Auth) else \
            f"{msg.op} before authenticating"
        with self._counts_lock:
            self.num_refused += 1
        logger.warning("side channel %s: refused %s: %s", self.address, peer, why)
        if self._log is not None:
            self._log({"event": "side_channel_refused", "peer": str(peer), "reason": why})
        return Failed(f"not authenticated: {why}")

    def serve(self, msg: Message) -> Reply:
        """The reply to one request of an authenticated connection."""
        if isinstance(msg, Hello):
            with self._peers_lock:  # a peer's agent is added once (NIXL keeps it)
                if msg.agent and msg.agent not in self._peers:
                    self._connect_peer(msg.agent)
                    self._peers.add(msg.agent)
            return self._welcome
        if isinstance(msg, Stage):
            return self._stage(msg.xfer, msg.first_block, msg.keys,
                               msg.num_blocks or len(msg.keys))
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
        if isinstance(msg, Auth):
            return Done()  # a repeated proof on an authenticated connection
        raise SideChannelError(f"{type(msg).__name__} is not a request")

    def _stage(self, xfer: str, first: int, keys: Sequence[bytes], num_blocks: int) -> Staged:
        """Read the files `keys` into slots of `xfer`'s blocks `first .. first + num_blocks`,
        in parallel, a slot per block (a file's blocks outside that range are dropped); the
        reply holds the slots of the blocks before the first file that failed (the prefill
        side recomputes from there on, so later blocks read meanwhile are not offered)."""
        g = self.blocks_per_file
        blocks = list(range(first, first + num_blocks))
        files = [list(range(f * g, (f + 1) * g))
                 for f in range(first // g, first // g + len(keys))]
        if not blocks or not files or (first + num_blocks - 1) // g != first // g + len(keys) - 1:
            raise SideChannelError(f"stage of {xfer}: {len(keys)} files of {g} blocks do not "
                                   f"hold blocks {first}..{first + num_blocks - 1}")
        slots = self.pool.alloc(xfer, blocks, is_read=True)
        slot_of = dict(zip(blocks, slots, strict=True))

        def read(key: bytes, file_blocks: list[int]) -> tuple[bool, float]:
            out = [self.pool.slots.slot(slot_of[b]) if b in slot_of
                   else bytearray(self.pool.full_block_bytes) for b in file_blocks]
            with self.pacer.reading(self.store.full_block_bytes) if self.pacer is not None \
                    else contextlib.nullcontext():
                r0 = time.monotonic()
                return self.store.get_into(key, out), time.monotonic() - r0

        ok = 0
        read_s = 0.0
        futures: list[Future[tuple[bool, float]]] = []
        try:
            futures += (self._readers.submit(read, key, file_blocks)
                        for key, file_blocks in zip(keys, files, strict=True))
            done = [f.result() for f in futures]
            read_s = sum(s for _, s in done)
            failed = next((f for f, (is_read, _) in enumerate(done) if not is_read), None)
            ok = num_blocks if failed is None else max(0, files[failed][0] - first)
        finally:
            wait(futures)  # no read may write into a slot after the transfer lets it go
            self.pool.mark_staged(xfer, blocks[:ok])
        with self._counts_lock:
            self.num_staged_blocks += ok
            self.num_stage_errors += ok < num_blocks
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
