"""Entry point of the `dualpath` console script.

Subcommands live in `dualpath.cli.commands.<name>`; each module defines
`register(subparsers) -> None`, which adds its parser and sets `func(args) -> int`.
Every user-facing error (`DualPathError`) becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence

from dualpath import __version__
from dualpath.cli import commands
from dualpath.core.errors import DualPathError

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    """The full parser with every subcommand module registered."""
    parser = argparse.ArgumentParser(
        prog="dualpath",
        description=(
            "DualPath (arXiv 2602.21548): dual-path KV-cache loading for agentic LLM inference. "
            "Analyze a cluster's bottleneck-free P/D range, generate and inspect agent traces, "
            "simulate clusters of any size, and run the real runtime on this machine."
        ),
        epilog="Run `dualpath <command> --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"dualpath {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv`, run the subcommand, return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        code: int = args.func(args)
    except DualPathError as exc:
        print(f"dualpath {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"dualpath {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`dualpath ... | head`): stop quietly, as Unix tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
