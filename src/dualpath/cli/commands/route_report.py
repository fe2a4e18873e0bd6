"""`dualpath route-report`: push a node's vLLM instances' state to a `dualpath route` router."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import textwrap

from dualpath.cli.commands.serve import API_KEY_ENV
from dualpath.core.errors import SpecError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from dualpath.integrations.vllm.reports import DEFAULT_INTERVAL_S, MISSED_REPORTS

    p = sub.add_parser(
        "route-report",
        help="report a node's vLLM instances to a dualpath router (instead of being polled)",
        description=textwrap.fill(
            "Run on a node beside its vLLM instances (its GPUs, or its data-parallel ranks): "
            "reads each instance's /health and /metrics on the node and pushes one report "
            "for all of them to the router every --interval, as the paper's leader engine "
            "reports its group. The router then stops polling them; if the reports stop for "
            f"{MISSED_REPORTS} intervals it takes the node's instances for down and polls "
            "them again. Give each --engine by the URL the router knows it by.", width=78),
        epilog="example: dualpath route-report --router http://r:8000 --node gpu-node-3 "
        "--engine http://10.0.0.3:8100 --engine http://10.0.0.3:8101",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--router", metavar="URL", required=True, help="the router's base URL")
    p.add_argument("--node", metavar="NAME", required=True, help="this node's name")
    p.add_argument("--engine", metavar="URL", action="append", required=True,
                   help="an instance on this node, by the URL the router routes to; repeat")
    p.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, metavar="S",
                   help="seconds between reports (default: %(default)s)")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get(API_KEY_ENV),
                   help=f"the router's API key (also read from ${API_KEY_ENV})")
    p.set_defaults(func=route_report)


def route_report(args: argparse.Namespace) -> int:
    from dualpath.integrations.vllm.router.reporter import report_node

    if not args.interval > 0:
        raise SpecError("route-report", "interval", args.interval, "must be > 0")
    for url in (args.router, *args.engine):
        if not url.startswith("http://"):
            raise SpecError("route-report", "url", url, "must start with http://")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(report_node(args.router.rstrip("/"), args.node,
                                [u.rstrip("/") for u in args.engine], args.interval,
                                args.api_key or None))
    return 0
