"""The staging service as a process of its own, and its size.

A vLLM worker process keeps its main thread busy between steps, which starves any other
Python thread in it for up to seconds; so the decode instance's staging service runs in a
process of its own (spawned by the decode worker's connector, exiting with it), with the
staging buffer in shared memory that both map: the service stages, the prefill side's NIXL
agent reads and writes it, the decode worker copies from it into its paged KV.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from dualpath.integrations.vllm.connector.side_channel.auth import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    load_secret,
)
from dualpath.integrations.vllm.connector.side_channel.client import (
    RemotePool,
    SideChannelClient,
)
from dualpath.integrations.vllm.connector.side_channel.cpus import instance_cpus, run_on
from dualpath.integrations.vllm.connector.side_channel.staging import StagingPool
from dualpath.integrations.vllm.connector.side_channel.tcp_server import DecodeSideChannel
from dualpath.integrations.vllm.connector.side_channel.wire import SideChannelError
from dualpath.store import BlockStore
from dualpath.transport.nixl import NixlAgent, agent_name
from dualpath.transport.pacing import Pacer
from dualpath.transport.slots import SlotPool
from dualpath.transport.traffic_class import KVTrafficClass

SHM_PREFIX = "dualpath-staging-"
TAG_ENV = "DUALPATH_INSTANCE_TAG"
"""The instance's tag, set by `dualpath vllm up`'s launcher: the buffer's shared memory is
named `dualpath-staging-<tag>-<pid>`, so the launcher can remove it whatever killed us."""
PR_SET_PDEATHSIG = 1

DEFAULT_STAGING_GB = 2.0
"""The staging buffer's default size. It must hold the KV of every prompt in flight between
the prefill and this decode instance: a 70B dense GQA model (64 layers, 8 KV heads, bf16) takes
320 KiB a token, so 2 GB hold about 6K tokens."""


def staging_slots(full_block_bytes: int, staging_gb: float | None = None,
                  staging_blocks: int | None = None) -> int:
    """The staging buffer's slots: `staging_blocks` when given, else as many Full Blocks as
    `staging_gb` (default `DEFAULT_STAGING_GB`) hold."""
    if staging_blocks is not None:
        if int(staging_blocks) < 1:
            raise ValueError(f"staging_blocks must be >= 1, got {staging_blocks}")
        return int(staging_blocks)
    gb = DEFAULT_STAGING_GB if staging_gb is None else float(staging_gb)
    num = int(gb * 1e9) // full_block_bytes
    if num < 1:
        raise ValueError(f"staging_gb={gb:g} holds no Full Block of {full_block_bytes} B")
    return num


def spawn_side_channel(address: str, store_root: str, full_block_bytes: int, num_slots: int,
                       storage_read_gbps: float | None, event_log: str | None,
                       namespace: str, timeout_s: float = 120.0,
                       command_prefix: Sequence[str] = (), env: dict[str, str] | None = None,
                       read_threads: int = 16, blocks_per_file: int = 1,
                       secret: bytes | None = None,
                       traffic_class: KVTrafficClass | None = None,
                       ) -> tuple[subprocess.Popen[bytes], RemotePool]:
    """Start the side-channel process on `address`; returns it and the worker's pool view.
    `command_prefix` runs it elsewhere (`netns.Host.command`: in an emulated host); it runs
    on the cores of this instance (`instance_cpus`), staging `read_threads` files at a
    time. A slot holds one Full Block (`full_block_bytes`), a store file `blocks_per_file`
    of them. `secret`: the cluster's shared secret (the process gets it in its environment,
    never on its command line; None: unauthenticated, loopback addresses only).
    `traffic_class`: the fabric class of its NIXL agent's transfers (default: the fabric's)."""
    cpus = instance_cpus(os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))
    cmd = [*command_prefix, sys.executable, "-m", __name__,
           "--address", address, "--store", store_root, "--full-block-bytes",
           str(full_block_bytes), "--slots", str(num_slots), "--namespace", namespace,
           "--parent", str(os.getpid()), "--cpus", ",".join(map(str, cpus)),
           "--read-threads", str(read_threads), "--blocks-per-file", str(blocks_per_file)]
    if storage_read_gbps:
        cmd += ["--storage-read-gbps", str(storage_read_gbps)]
    if event_log:
        cmd += ["--event-log", event_log]
    if traffic_class is not None and not traffic_class.is_default:
        cmd += ["--kv-traffic-class", traffic_class.to_json()]
    child_env = {**os.environ, **(env or {})}
    child_env.pop(SECRET_FILE_ENV, None)
    if secret is not None:
        child_env[SECRET_ENV] = secret.decode()
    else:
        child_env.pop(SECRET_ENV, None)
    proc = subprocess.Popen(cmd, env=child_env)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise SideChannelError(f"side channel process on {address} exited with "
                                   f"{proc.returncode}")
        try:
            client = SideChannelClient(address, secret=secret)
            welcome = client.hello()
            break
        except (OSError, SideChannelError):
            if time.monotonic() > deadline:
                proc.kill()
                raise SideChannelError(f"side channel on {address} did not start in "
                                       f"{timeout_s:.0f} s") from None
            time.sleep(0.2)
    return proc, RemotePool(client, welcome)


def _main() -> None:
    import argparse
    import signal

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
    ap.add_argument("--read-threads", type=int, default=16,
                    help="store reads of a stage in flight at once")
    ap.add_argument("--kv-traffic-class", help="the NIXL agent's fabric class (JSON of "
                    "transport.traffic_class.KVTrafficClass)")
    ap.add_argument("--blocks-per-file", type=int, default=1,
                    help="Full Blocks (staging slots) per store file")
    args = ap.parse_args()
    if args.cpus:
        run_on(args.cpus)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # clean up the shared memory
    # SIGTERM (and so the cleanup) the moment the decode worker dies, however it dies: the
    # poll of the parent below takes up to half a second, and a worker killed with its
    # engine may leave us running otherwise (Linux; nothing elsewhere).
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if args.parent is not None and os.getppid() != args.parent:
        return  # the worker died before the line above
    tag = os.environ.get(TAG_ENV, "")
    slots = SlotPool(f"{SHM_PREFIX}{tag + '-' if tag else ''}{os.getpid()}",
                     args.full_block_bytes, args.slots)
    slots.touch()  # first touch here, once
    pool = StagingPool(slots)
    store = BlockStore(args.store, args.full_block_bytes * args.blocks_per_file,
                       is_durable=False)
    kv_class = KVTrafficClass.from_json(args.kv_traffic_class) if args.kv_traffic_class \
        else None
    agent = NixlAgent(agent_name("decode"), progress_thread=True,  # the prefill side's target
                      traffic_class=kv_class)
    agent.register([(pool.base, slots.capacity_bytes)])
    log_path = args.event_log

    def log(record: dict[str, Any]) -> None:
        if log_path:
            line = json.dumps({"t": round(time.time(), 3), "process": "side_channel",
                               **record}) + "\n"
            with open(log_path, "a", encoding="utf-8") as f:
                f.write(line)

    channel = DecodeSideChannel(
        args.address, pool, store, agent.metadata(), agent.connect, namespace=args.namespace,
        secret=load_secret(),
        pacer=Pacer.from_gbps(args.storage_read_gbps, "storage_read")
        if args.storage_read_gbps else None, log=log, read_threads=args.read_threads)
    try:
        while args.parent is None or os.getppid() == args.parent:
            time.sleep(0.5)
    finally:
        channel.close()
        agent.close()
        pool.close()  # unlinks the segment, unless the decode worker already did


if __name__ == "__main__":
    _main()
