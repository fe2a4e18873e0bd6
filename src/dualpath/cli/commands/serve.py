"""`dualpath serve`: the real runtime behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from dualpath.cli.commands.run import MODE_CHOICES, _config, _model_source, add_cluster_arguments
from dualpath.core.errors import SpecError

DEFAULT_BUFFER_MIB = 1024
API_KEY_ENV = "DUALPATH_API_KEY"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API on the emulated cluster",
        description=textwrap.fill(
            "Start an emulated PD-disaggregated cluster on this machine (as `dualpath run` "
            "does: nodes are processes, NIC bandwidths are emulated, KV blocks move as real "
            "bytes through storage, DRAM buffers and engines) and serve it over HTTP: "
            "POST /v1/chat/completions and /v1/completions (streaming too), /tokenize and "
            "/detokenize, GET /v1/models, /health, /version, /stats and /metrics "
            "(Prometheus). Every request's prompt KV is persisted block by block, so a "
            "follow-up turn that extends an earlier conversation reads those blocks from "
            "storage (usage.prompt_tokens_details.cached_tokens) on the path the scheduler "
            "picks. Chat prompts use the model's own chat template (the GGUF's or "
            "tokenizer_config.json's; ChatML for the tiny model). Ctrl-C stops.",
            width=78,
        ),
        epilog="example: dualpath serve --port 8000, then\n  curl localhost:8000/v1/chat/"
        "completions -H 'Content-Type: application/json' -d '{\"messages\": [{\"role\": "
        "\"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 20}'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    s.add_argument("--port", type=int, default=8000, help="port (default: %(default)s; 0: any "
                   "free port, printed at start)")
    s.add_argument("--served-model-name", metavar="NAME",
                   help="the model id clients send (default: the --model value)")
    s.add_argument("--mode", choices=MODE_CHOICES, default="dualpath",
                   help="cluster mode (default: %(default)s)")
    s.add_argument("--store", metavar="DIR", help="block store root; KV persisted there "
                   "outlives the server (default: a temp folder removed at exit)")
    s.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="fail a request with no result after S seconds (default: %(default)s)")
    s.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="after a node or the scheduler fails, start a new cluster on the same "
                   "store (its KV is kept) at most N times within --restart-window-s "
                   "(default: %(default)s)")
    s.add_argument("--restart-window-s", type=float, default=3600.0, metavar="S",
                   help="the window --max-restarts counts restarts in; older ones no longer "
                   "count (default: %(default)s)")
    s.add_argument("--api-key", metavar="KEY", default=os.environ.get(API_KEY_ENV),
                   help="callers must send 'Authorization: Bearer KEY' (also read from "
                   f"${API_KEY_ENV}; default: no key). /health, /version and /metrics stay "
                   "open")
    s.add_argument("--quiet", action="store_true", help="no per-request log lines")
    add_cluster_arguments(p, model="smollm2", prefill_nodes=1, decode_nodes=1,
                          buffer_help=f"DRAM buffer per node, MiB (default: "
                          f"{DEFAULT_BUFFER_MIB}; it bounds the longest prompt)")
    p.set_defaults(func=serve, buffer_mib=DEFAULT_BUFFER_MIB, temperature=1.0, seed=0)


def serve(args: argparse.Namespace) -> int:
    from dualpath.runtime.model.model_source import model_tokenizer
    from dualpath.serve import ServingEngine, make_server

    if not 0 <= args.port <= 65535:
        raise SpecError("serve", "port", args.port, "must be in [0, 65535]")
    if args.max_restarts < 0:
        raise SpecError("serve", "max_restarts", args.max_restarts, "must be >= 0")
    if not args.restart_window_s > 0:
        raise SpecError("serve", "restart_window_s", args.restart_window_s, "must be > 0")
    if args.request_timeout <= 0:
        raise SpecError("serve", "request_timeout", args.request_timeout, "must be > 0")
    source = _model_source(args)
    tokenizer = model_tokenizer(source)
    with tempfile.TemporaryDirectory(prefix="dualpath-serve-") as tmp:
        store = args.store or tmp
        cfg: Any = _config(args, args.mode, store)
        name = args.served_model_name or (Path(args.model).name if source.kind == "path"
                                          else args.model)
        print(f"dualpath serve: starting {cfg.num_prefill_nodes}P{cfg.num_decode_nodes}D x "
              f"{cfg.engines_per_node} engines/node, model {name}, mode {cfg.mode} ...",
              file=sys.stderr, flush=True)
        def log(message: str) -> None:
            print(f"dualpath serve: {message}", file=sys.stderr, flush=True)

        with ServingEngine(cfg, tokenizer, name, args.request_timeout, args.max_restarts,
                           log, args.restart_window_s) as engine:
            server = make_server(engine, args.host, args.port, is_logging=not args.quiet,
                                 api_key=args.api_key or None)
            host, port = str(server.server_address[0]), int(server.server_address[1])
            print(f"dualpath serve: http://{host}:{port}/v1 (max {engine.max_sequence_tokens} "
                  f"tokens per sequence; store {store}); Ctrl-C stops", file=sys.stderr,
                  flush=True)
            def interrupt(signum: int, frame: object) -> None:
                engine.begin_stop()  # before the nodes' deaths (same signal) look like faults
                server.stop()

            previous = {sig: signal.signal(sig, interrupt)
                        for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                server.serve_forever()
                print("dualpath serve: stopping", file=sys.stderr)
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
                server.server_close()
    return 0
