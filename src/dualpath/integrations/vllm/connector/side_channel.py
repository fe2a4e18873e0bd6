"""The decode instance's half of the DE read path: a staging buffer of Full Block slots, and the
side channel (TCP, one JSON object per line) through which prefill workers use it.

Per request (`xfer`, the router's id), the staging buffer holds the blocks the decode instance
will load into its paged KV when the request arrives for decoding:

- `stage`: the decode worker reads the request's DE-side hit blocks from storage into free slots
  (storage -> decode DRAM); the prefill worker then pulls them over NIXL, layer by layer.
- `alloc` + `commit`: the prefill worker writes the blocks the decode instance lacks (those it
  read itself and those it computed, the partial tail included) into slots over NIXL and
  commits them; only committed or staged slots are ever loaded.

Messages (request -> reply), each one line of JSON:

    {"op": "hello", "agent": b64 or ""}          -> {"agent": b64, "full_block_bytes", ...}
    {"op": "stage", "xfer", "first_block", "keys": [hex]}
                                   -> {"slots": [addr], "ok": n, "read_s": store read time}
    {"op": "alloc", "xfer", "blocks": [index]}   -> {"slots": [addr]}
    {"op": "commit", "xfer"}                     -> {"ok": true}
    any failure                                  -> {"error": "why"}

A transfer nobody loads (its request never reached the decode instance) is dropped after
`ttl_s`, and whenever the buffer runs out of slots, the oldest transfers go first.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dualpath.core.store import BlockStore
from dualpath.integrations.vllm.connector.pacing import ReadPacer


class SideChannelError(RuntimeError):
    """A side-channel request the decode instance refused, or a broken connection."""


@dataclass
class _Xfer:
    slots: dict[int, int] = field(default_factory=dict)
    """block index (in the request) -> slot."""
    staged: set[int] = field(default_factory=set)
    """Blocks read from storage here (valid once staged)."""
    committed: bool = False
    """The prefill worker's pushed blocks are complete."""
    created: float = field(default_factory=time.monotonic)


class StagingPool:
    """`num_slots` Full Block slots in one host buffer, handed out per transfer. Thread-safe."""

    def __init__(self, num_slots: int, full_block_bytes: int, ttl_s: float = 600.0,
                 buffer: torch.Tensor | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"staging_blocks must be >= 1, got {num_slots}")
        self.full_block_bytes = full_block_bytes
        self.num_slots = num_slots
        self.buffer = buffer if buffer is not None else \
            torch.zeros(num_slots * full_block_bytes, dtype=torch.uint8)
        if self.buffer.numel() < num_slots * full_block_bytes:
            raise ValueError("staging buffer smaller than its slots")
        self.base = int(self.buffer.data_ptr())
        self.ttl_s = ttl_s
        self._free = list(range(num_slots - 1, -1, -1))
        self._xfers: dict[str, _Xfer] = {}
        self._lock = threading.Lock()
        self.num_expired = 0

    def address(self, slot: int) -> int:
        return self.base + slot * self.full_block_bytes

    def view(self, slot: int) -> torch.Tensor:
        lo = slot * self.full_block_bytes
        return self.buffer[lo:lo + self.full_block_bytes]

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def alloc(self, xfer: str, blocks: Sequence[int]) -> list[int]:
        """Slots for `blocks` of `xfer` (a block given twice keeps its slot)."""
        with self._lock:
            x = self._xfers.setdefault(xfer, _Xfer())
            need = [b for b in blocks if b not in x.slots]
            self._expire(len(need), keep=xfer)
            if len(need) > len(self._free):
                raise SideChannelError(f"staging buffer full: {len(need)} slots wanted, "
                                       f"{len(self._free)} free of {self.num_slots}")
            for b in need:
                x.slots[b] = self._free.pop()
            return [x.slots[b] for b in blocks]

    def mark_staged(self, xfer: str, blocks: Sequence[int]) -> None:
        """Mark `blocks` of `xfer` as holding their stored bytes; a transfer released or
        expired meanwhile (its prefill gave up and recomputed) is a `SideChannelError`."""
        with self._lock:
            x = self._xfers.get(xfer)
            if x is None:
                raise SideChannelError(f"transfer {xfer} was released while staging")
            x.staged.update(blocks)

    def commit(self, xfer: str) -> None:
        with self._lock:
            x = self._xfers.get(xfer)
            if x is None:
                raise SideChannelError(f"unknown transfer {xfer}")
            x.committed = True

    def lookup(self, xfer: str, blocks: Sequence[int]) -> list[int | None]:
        """The slot of each block that holds valid bytes (staged, or pushed and committed)."""
        with self._lock:
            x = self._xfers.get(xfer)
            if x is None:
                return [None] * len(blocks)
            return [x.slots[b] if b in x.slots and (b in x.staged or x.committed) else None
                    for b in blocks]

    def release(self, xfer: str) -> None:
        with self._lock:
            x = self._xfers.pop(xfer, None)
            if x is not None:
                self._free.extend(x.slots.values())

    def _expire(self, need: int, keep: str) -> None:
        now = time.monotonic()
        for name in sorted(self._xfers, key=lambda n: self._xfers[n].created):
            x = self._xfers[name]
            if name == keep or (now - x.created < self.ttl_s and len(self._free) >= need):
                continue
            self._free.extend(x.slots.values())
            del self._xfers[name]
            self.num_expired += 1


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class DecodeSideChannel:
    """The decode worker's side-channel server around its `StagingPool` and `BlockStore`."""

    def __init__(self, address: str, pool: StagingPool, store: BlockStore,
                 agent_metadata: bytes, connect_peer: Callable[[bytes], str],
                 info: Mapping[str, Any], pacer: ReadPacer | None = None,
                 log: Callable[[dict[str, Any]], None] | None = None) -> None:
        host, port = split_address(address)
        self.pool = pool
        self.store = store
        self.pacer = pacer
        """This decode node's emulated storage NIC (None: unpaced)."""
        self._agent_metadata = agent_metadata
        self._connect_peer = connect_peer
        self._info = dict(info)
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
                    msg: dict[str, Any] = {}
                    try:
                        msg = json.loads(line)
                        reply = channel.serve(msg)
                    except Exception as e:  # the peer gets the reason
                        reply = {"error": f"{type(e).__name__}: {e}"}
                    self.wfile.write((json.dumps(reply) + "\n").encode())
                    self.wfile.flush()
                    if channel._log is not None:
                        channel._log({"event": "side_channel", "op": msg.get("op"),
                                      "xfer": msg.get("xfer"), "error": reply.get("error"),
                                      "ok": reply.get("ok"), "read_s": reply.get("read_s"),
                                      "s": round(time.monotonic() - t0, 4)})

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="dualpath-side-channel")
        self._thread.start()

    def serve(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "hello":
            metadata = base64.b64decode(msg["agent"]) if msg.get("agent") else b""
            with self._peers_lock:  # a peer's agent is added once (NIXL keeps it)
                if metadata and metadata not in self._peers:
                    self._connect_peer(metadata)
                    self._peers.add(metadata)
            return {"agent": _b64(self._agent_metadata), **self._info}
        if op == "stage":
            return self._stage(str(msg["xfer"]), int(msg["first_block"]),
                               [bytes.fromhex(k) for k in msg["keys"]])
        if op == "alloc":
            slots = self.pool.alloc(str(msg["xfer"]), [int(b) for b in msg["blocks"]])
            return {"slots": [self.pool.address(s) for s in slots]}
        if op == "commit":
            self.pool.commit(str(msg["xfer"]))
            return {"ok": True}
        if op == "lookup":  # the decode worker: which slots hold a request's blocks
            return {"slots": self.pool.lookup(str(msg["xfer"]), [int(b) for b in msg["blocks"]])}
        if op == "release":  # the decode worker loaded them
            self.pool.release(str(msg["xfer"]))
            return {"ok": True}
        raise SideChannelError(f"unknown op {op!r}")

    def _stage(self, xfer: str, first: int, keys: Sequence[bytes]) -> dict[str, Any]:
        blocks = list(range(first, first + len(keys)))
        slots = self.pool.alloc(xfer, blocks)
        ok = 0
        read_s = 0.0
        for slot, key in zip(slots, keys, strict=True):
            with self.pacer.reading(self.store.full_block_bytes) if self.pacer is not None \
                    else contextlib.nullcontext():
                r0 = time.monotonic()
                is_read = self.store.get_into(key, self.pool.view(slot).numpy())
                read_s += time.monotonic() - r0
            if not is_read:
                self.num_stage_errors += 1
                break  # the prefill side recomputes from the first failed block on
            ok += 1
        self.pool.mark_staged(xfer, blocks[:ok])
        self.num_staged_blocks += ok
        return {"slots": [self.pool.address(s) for s in slots[:ok]], "ok": ok,
                "read_s": round(read_s, 4)}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"side channel address {address!r} is not host:port")
    return host or "127.0.0.1", int(port)


class SideChannelClient:
    """A prefill worker's connection to one decode instance's side channel (thread-safe)."""

    def __init__(self, address: str, timeout_s: float = 60.0) -> None:
        self.address = address
        self._sock = socket.create_connection(split_address(address), timeout=timeout_s)
        self._rfile = self._sock.makefile("rb")
        self._lock = threading.Lock()

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            self.send(op, **fields)
            return self.receive()

    def send(self, op: str, **fields: Any) -> None:
        """Send a request without waiting (`receive` gets the replies in order); the caller
        owns the connection meanwhile."""
        try:
            self._sock.sendall((json.dumps({"op": op, **fields}) + "\n").encode())
        except OSError as e:
            raise SideChannelError(f"side channel {self.address}: {e}") from e

    def receive(self) -> dict[str, Any]:
        """The reply to the oldest request not yet answered."""
        try:
            line = self._rfile.readline()
        except OSError as e:
            raise SideChannelError(f"side channel {self.address}: {e}") from e
        if not line:
            raise SideChannelError(f"side channel {self.address} closed the connection")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise SideChannelError(f"side channel {self.address}: {reply['error']}")
        return reply

    def hello(self, agent_metadata: bytes = b"") -> dict[str, Any]:
        """Exchange agents (empty: only read the decode side's info)."""
        reply = self.call("hello", agent=_b64(agent_metadata) if agent_metadata else "")
        reply["agent"] = base64.b64decode(reply["agent"])
        return reply

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._rfile.close()
            self._sock.close()


# -- the side channel as its own process ---------------------------------------------------
# A vLLM worker process keeps its main thread busy between steps, which starves any other
# Python thread in it for up to seconds; so the decode instance's buffer service runs in a
# process of its own (spawned by the decode worker's connector, exiting with it), with the
# staging buffer in shared memory that both map: the service stages, the prefill side's NIXL
# agent reads and writes it, the decode worker copies from it into its paged KV.

SHM_PREFIX = "dualpath-staging-"


class RemotePool:
    """The decode worker's view of a side-channel process's staging buffer."""

    def __init__(self, client: SideChannelClient, shm_name: str, num_slots: int,
                 full_block_bytes: int) -> None:
        from multiprocessing import shared_memory

        self.client = client
        self.num_slots = num_slots
        self.full_block_bytes = full_block_bytes
        self._shm = shared_memory.SharedMemory(name=shm_name, create=False)
        # Both processes map it now: its name is no longer needed, and unlinking it here means
        # no segment outlives them, however they end (the memory goes with the last mapping).
        # This also balances Python's registration of the attached segment with this
        # process's resource tracker (before 3.13), which would otherwise warn of a leak.
        with contextlib.suppress(OSError):
            self._shm.unlink()
        self._buffer = torch.frombuffer(self._shm.buf, dtype=torch.uint8)

    def lookup(self, xfer: str, blocks: Sequence[int]) -> list[int | None]:
        slots: list[int | None] = self.client.call("lookup", xfer=xfer, blocks=list(blocks))[
            "slots"]
        return slots

    def view(self, slot: int) -> torch.Tensor:
        lo = slot * self.full_block_bytes
        return self._buffer[lo:lo + self.full_block_bytes]

    def release(self, xfer: str) -> None:
        self.client.call("release", xfer=xfer)

    def close(self) -> None:
        del self._buffer
        with contextlib.suppress(BufferError, OSError):
            self._shm.close()


def instance_cpus(bind: str | None) -> list[int]:
    """The cores of the vLLM instance whose `VLLM_CPU_OMP_THREADS_BIND` is `bind` (a core
    list such as "0-3,8|4-7", one part per rank); for "auto", "nobind" or None, the cores the
    worker's parent (vLLM's engine process, which vLLM does not pin) may use. The staging
    service runs on these: a process the worker starts would otherwise inherit the one core
    vLLM pins the worker's main thread to."""
    try:
        every = sorted(os.sched_getaffinity(os.getppid()) | os.sched_getaffinity(0))
    except OSError:
        every = sorted(os.sched_getaffinity(0) | set(range(os.cpu_count() or 1)))
    if bind is None or bind.strip() in ("", "auto", "nobind"):
        return every
    cpus: set[int] = set()
    for part in bind.replace("|", ",").split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={bind!r}: {part!r} is not a core "
                             "id or a range a-b")
        cpus.update(range(int(lo), int(hi if sep else lo) + 1))
    return sorted(cpus)


def spawn_side_channel(address: str, store_root: str, full_block_bytes: int, num_slots: int,
                       storage_read_gbps: float | None, event_log: str | None,
                       namespace: str, timeout_s: float = 120.0,
                       command_prefix: Sequence[str] = (), env: dict[str, str] | None = None,
                       ) -> tuple[Any, RemotePool]:
    """Start the side-channel process on `address`; returns it and the worker's pool view.
    `command_prefix` runs it elsewhere (`netns.Host.command`: in an emulated host); it runs
    on the cores of this instance (`instance_cpus`)."""
    import subprocess
    import sys

    cpus = instance_cpus(os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))
    cmd = [*command_prefix, sys.executable, "-m",
           "dualpath.integrations.vllm.connector.side_channel",
           "--address", address, "--store", store_root, "--full-block-bytes",
           str(full_block_bytes), "--slots", str(num_slots), "--namespace", namespace,
           "--parent", str(os.getpid()), "--cpus", ",".join(map(str, cpus))]
    if storage_read_gbps:
        cmd += ["--storage-read-gbps", str(storage_read_gbps)]
    if event_log:
        cmd += ["--event-log", event_log]
    proc = subprocess.Popen(cmd, env=None if env is None else {**os.environ, **env})
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise SideChannelError(f"side channel process on {address} exited with "
                                   f"{proc.returncode}")
        try:
            client = SideChannelClient(address)
            info = client.hello()
            break
        except (OSError, SideChannelError):
            if time.monotonic() > deadline:
                proc.kill()
                raise SideChannelError(f"side channel on {address} did not start in "
                                       f"{timeout_s:.0f} s") from None
            time.sleep(0.2)
    return proc, RemotePool(client, str(info["shm"]), int(info["num_slots"]), full_block_bytes)


def _serve_main() -> None:
    import argparse
    import signal
    import sys
    from multiprocessing import shared_memory

    from dualpath.integrations.vllm.connector.nixl_link import NixlLink

    ap = argparse.ArgumentParser(description="DualPath's decode-side staging buffer service "
                                 "(started by DualPathConnector on a decode instance)")
    ap.add_argument("--address", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--full-block-bytes", type=int, required=True)
    ap.add_argument("--slots", type=int, required=True)
    ap.add_argument("--namespace", default="")
    ap.add_argument("--storage-read-gbps", type=float)
    ap.add_argument("--event-log")
    ap.add_argument("--parent", type=int, help="exit when this process is gone")
    ap.add_argument("--cpus", help="run on these cores, comma-separated (default: inherited)")
    args = ap.parse_args()
    if args.cpus:  # before any thread starts, so that every thread has them
        try:
            os.sched_setaffinity(0, [int(c) for c in args.cpus.split(",")])
        except (OSError, ValueError) as e:  # it still works, on the inherited cores
            print(f"dualpath side channel: cannot run on cores {args.cpus} ({e}); staying on "
                  f"{sorted(os.sched_getaffinity(0))}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # clean up the shared memory
    size = args.slots * args.full_block_bytes
    shm = shared_memory.SharedMemory(name=f"{SHM_PREFIX}{os.getpid()}", create=True, size=size)
    buffer = torch.frombuffer(shm.buf, dtype=torch.uint8)
    buffer.zero_()  # first touch here, once
    pool = StagingPool(args.slots, args.full_block_bytes, buffer=buffer)
    store = BlockStore(args.store, args.full_block_bytes, is_durable=False)
    link = NixlLink("decode", progress_thread=True)  # the target of the prefill side's I/O
    link.register([(pool.base, size)])
    log_path = args.event_log

    def log(record: dict[str, Any]) -> None:
        if log_path:
            line = json.dumps({"t": round(time.time(), 3), "process": "side_channel",
                               **record}) + "\n"
            with open(log_path, "a", encoding="utf-8") as f:
                f.write(line)

    channel = DecodeSideChannel(
        args.address, pool, store, link.metadata(), link.connect,
        {"full_block_bytes": args.full_block_bytes, "namespace": args.namespace,
         "num_slots": args.slots, "shm": shm.name},
        pacer=ReadPacer(args.storage_read_gbps) if args.storage_read_gbps else None, log=log)
    try:
        while args.parent is None or os.getppid() == args.parent:
            time.sleep(0.5)
    finally:
        channel.close()
        link.close()
        del buffer
        pool.buffer = torch.empty(0, dtype=torch.uint8)
        with contextlib.suppress(BufferError, OSError):
            shm.close()
        try:
            shm.unlink()
        except FileNotFoundError:  # the decode worker unlinked it once it had mapped it
            from multiprocessing import resource_tracker

            with contextlib.suppress(Exception):
                resource_tracker.unregister(getattr(shm, "_name", "/" + shm.name),
                                            "shared_memory")
        except OSError:
            pass


if __name__ == "__main__":
    _serve_main()
