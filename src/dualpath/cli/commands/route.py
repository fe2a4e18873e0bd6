"""`dualpath route`: the OpenAI-compatible router in front of prefill and decode vLLM instances."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import textwrap
from pathlib import Path

from dualpath.cli.commands.serve import API_KEY_ENV
from dualpath.cli.common import GB_PER_S, refuse_flags, renamed
from dualpath.core.errors import SpecError
from dualpath.http import LOG_LEVELS
from dualpath.integrations.vllm.router.policy import (
    DEFAULT_BETA_TOKENS,
    DEFAULT_STORAGE_GBPS,
    ROUTE_MODES,
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "route",
        help="route OpenAI API requests to prefill and decode vLLM instances (DualPath's "
        "PE / DE read-path choice)",
        description=textwrap.fill(
            "An OpenAI-compatible router (POST /v1/completions and /v1/chat/completions, "
            "streaming too; GET /v1/models, /health, /stats, /metrics) in front of P prefill "
            "and D decode vLLM instances that run DualPathConnector on one shared block "
            "store. Per request it tokenizes the prompt on a prefill instance, counts the "
            "prompt's stored KV prefix in --store, and lets DualPath's scheduler choose the "
            "prefill instance, the decode instance and which storage NIC reads the stored "
            "blocks: the prefill node's (PE read path) or the decode node's (DE read path). "
            "The prefill instance computes the prompt (max_tokens 1) and hands the KV to the "
            "decode instance, whose reply goes back to the client. Start the vLLM instances "
            "with the connector first: the router reads the store's manifest they publish. "
            "A request no instance can take waits (up to --queue-timeout).",
            width=78,
        ),
        epilog="example: dualpath route --store /mnt/kv --prefill http://p0:8100 "
        "--decode http://d0:8200 --side d0:5600 --port 8000\n"
        "modes: basic = PE read path only, round robin; dualpath = Algorithm 1, two-level "
        "decode scheduling,\n  the read on the side with the shorter read queue; split = as "
        "dualpath, one request's read split across both sides",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    i = p.add_argument_group("instances")
    i.add_argument("--prefill", metavar="URL", action="append", default=[],
                   help="a prefill vLLM instance's base URL (http://host:port); repeat for more")
    i.add_argument("--decode", metavar="URL", action="append", default=[],
                   help="a decode vLLM instance's base URL; repeat for more, each with its --side")
    i.add_argument("--side", metavar="HOST:PORT", action="append", default=[],
                   help="the side channel of the --decode given at the same position (where "
                   "prefill instances reach its KV buffer)")
    i.add_argument("--instances", metavar="FILE", help="the instances as JSON lines, one "
                   'per instance: {"role": "prefill"|"decode", "url": URL, "side": HOST:PORT '
                   '(decode), "node": NAME}; instances with one node name share its storage '
                   "NIC and are one group, as a node's GPUs or data-parallel ranks are "
                   "(instead of --prefill/--decode/--side, or beside them)")
    i.add_argument("--store", metavar="DIR", required=True,
                   help="the block store the connectors use (their store_path)")
    i.add_argument("--model", metavar="NAME", help="the model whose manifest to use when "
                   "several share the store; also the model of requests that name none")
    s = p.add_argument_group("policy")
    s.add_argument("--mode", choices=ROUTE_MODES, default="dualpath",
                   help="scheduling mode (default: %(default)s)")
    s.add_argument("--force-read-side", choices=("pe", "de"), help="read every hit on this "
                   "side whatever the mode chose (a diagnostic: shows one path alone)")
    s.add_argument("--alpha-tokens", type=float, metavar="T", help="a node's read queue is "
                   "short while at most T tokens (default: 3 s of --storage-nic-gb-per-s "
                   "reads)")
    s.add_argument("--storage-nic-gb-per-s", type=float, default=DEFAULT_STORAGE_GBPS / 8,
                   metavar=GB_PER_S, help="one node's storage NIC rate, in GB/s (400 Gb/s = "
                   "50), for the default alpha (default: %(default)s)")
    refuse_flags(p, {"--storage-gbps": renamed("--storage-nic-gb-per-s", "Gb/s", "GB/s: "
                                               "divide by 8")})
    s.add_argument("--beta-tokens", type=float, default=DEFAULT_BETA_TOKENS, metavar="T",
                   help="a prefill instance with more than T prompt tokens in flight takes no "
                   "more (paper: 5 s of its work; default: %(default)s)")
    s.add_argument("--decode-kv-gib", type=float, metavar="GIB", help="KV memory of each "
                   "decode instance (default: from its /metrics vllm:cache_config_info; "
                   "unknown: unlimited)")
    s.add_argument("--queue-timeout", type=float, default=60.0, metavar="S",
                   help="503 for a request no instance took within S s (default: %(default)s)")
    s.add_argument("--upstream-timeout", type=float, default=600.0, metavar="S",
                   help="504 for an instance silent for S s (default: %(default)s)")
    s.add_argument("--poll-interval", type=float, default=0.5, metavar="S",
                   help="poll every instance's /metrics every S s (default: %(default)s)")
    h = p.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    h.add_argument("--port", type=int, default=8000,
                   help="port (default: %(default)s; 0: any free port, printed at start)")
    h.add_argument("--api-key", metavar="KEY", default=os.environ.get(API_KEY_ENV),
                   help="callers must send 'Authorization: Bearer KEY' (also read from "
                   f"${API_KEY_ENV}; default: no key). /health, /metrics, /docs and /openapi.json "
                   "stay open")
    h.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                   help="uvicorn's log level (default: %(default)s)")
    p.set_defaults(func=route)


def route(args: argparse.Namespace) -> int:
    from dualpath.http.server import HttpServer, ServerConfig
    from dualpath.integrations.vllm.manifest import find_manifest
    from dualpath.integrations.vllm.router.app import make_app
    from dualpath.integrations.vllm.router.config import RouterConfig
    from dualpath.integrations.vllm.router.policy import route_params
    from dualpath.integrations.vllm.router.router import Router

    if len(args.side) != len(args.decode):
        raise SpecError("route", "side", len(args.side), f"give one --side per --decode "
                        f"({len(args.decode)} --decode, {len(args.side)} --side)")
    prefill: list[tuple[str, str | None]] = [(u.rstrip("/"), None) for u in args.prefill]
    decode: list[tuple[str, str, str | None]] = [
        (u.rstrip("/"), s, None) for u, s in zip(args.decode, args.side, strict=True)]
    if args.instances:
        more_prefill, more_decode = read_instances(Path(args.instances))
        prefill += more_prefill
        decode += more_decode
    if not prefill or not decode:
        raise SpecError("route", "instances", (len(prefill), len(decode)), "needs at least "
                        "one prefill and one decode instance (--prefill/--decode or "
                        "--instances)")
    has_nodes = any(n is not None for _, n in prefill) or any(n is not None
                                                                for _, _, n in decode)
    if not 0 <= args.port <= 65535:
        raise SpecError("route", "port", args.port, "must be in [0, 65535]")
    if args.decode_kv_gib is not None and not args.decode_kv_gib > 0:
        raise SpecError("route", "decode_kv_gib", args.decode_kv_gib, "must be > 0")
    store = Path(args.store)
    if not store.is_dir():
        raise SpecError("route", "store", args.store, "no such folder")
    try:
        manifest = find_manifest(store, args.model)
    except SpecError as e:
        why = str(e).split(": ", 1)[-1]
        raise SpecError("route", "store", args.store, f"{why}; start the vLLM instances with "
                        "DualPathConnector (store_path = this folder) first") from None
    kv_per_token = manifest.full_block_bytes / manifest.block_size
    params, _ = route_params(args.mode, manifest.block_size, kv_per_token,
                             args.alpha_tokens, args.beta_tokens,
                             args.storage_nic_gb_per_s * 8)
    cfg = RouterConfig(
        prefill=tuple(u for u, _ in prefill), decode=tuple(u for u, _, _ in decode),
        sides=tuple(s for _, s, _ in decode),
        prefill_nodes=tuple(n or u for u, n in prefill) if has_nodes else None,
        decode_nodes=tuple(n or u for u, _, n in decode) if has_nodes else None,
        store=store, manifest=manifest, params=params, mode=args.mode,
        model=args.model, queue_timeout_s=args.queue_timeout,
        upstream_timeout_s=args.upstream_timeout, poll_interval_s=args.poll_interval,
        decode_kv_capacity_bytes=None if args.decode_kv_gib is None
        else int(args.decode_kv_gib * 2**30), forced_read_side=args.force_read_side)
    server = HttpServer(make_app(Router(cfg)), args.host, args.port,
                        ServerConfig(api_key=args.api_key or None, log_level=args.log_level))
    print(f"dualpath route: {server.url}/v1, mode {args.mode}, "
          f"{len(cfg.prefill)} prefill + {len(cfg.decode)} decode instances, model "
          f"{manifest.model} (block {manifest.block_size} tokens, alpha "
          f"{params.alpha_tokens:.0f}, beta {params.beta_tokens:.0f} tokens); Ctrl-C stops",
          file=sys.stderr, flush=True)

    def interrupt(signum: int, frame: object) -> None:
        server.stop()

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.serve_forever()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.server_close()
    return 0


def read_instances(path: Path) -> tuple[list[tuple[str, str | None]],
                                        list[tuple[str, str, str | None]]]:
    """`--instances`: (prefill (url, node)), (decode (url, side, node)); a bad line is an
    error naming it."""
    prefill: list[tuple[str, str | None]] = []
    decode: list[tuple[str, str, str | None]] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise SpecError("route", "instances", str(path), f"unreadable: {e}") from e
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{n}"
        try:
            raw = json.loads(line)
        except ValueError as e:
            raise SpecError(where, "line", line[:60], f"not JSON: {e}") from e
        if not isinstance(raw, dict):
            raise SpecError(where, "line", line[:60], "must be a JSON object")
        role, url, node = raw.get("role"), raw.get("url"), raw.get("node")
        if not isinstance(url, str) or not url:
            raise SpecError(where, "url", url, "must be a base URL (http://host:port)")
        if node is not None and (not isinstance(node, str) or not node):
            raise SpecError(where, "node", node, "must be a non-empty name")
        if role == "prefill":
            prefill.append((url.rstrip("/"), node))
        elif role == "decode":
            side = raw.get("side")
            if not isinstance(side, str) or not side:
                raise SpecError(where, "side", side, "a decode instance needs its side "
                                "channel (HOST:PORT)")
            decode.append((url.rstrip("/"), side, node))
        else:
            raise SpecError(where, "role", role, "must be prefill or decode")
    return prefill, decode
