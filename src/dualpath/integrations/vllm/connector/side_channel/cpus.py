"""The cores the staging service runs on: its vLLM instance's, never the one core vLLM pins
the worker's main thread to (a process the worker starts would otherwise inherit it, and
there the service starved, with the engine, for tens of seconds)."""

from __future__ import annotations

import os
import sys


def instance_cpus(bind: str | None) -> list[int]:
    """The cores of the vLLM instance whose `VLLM_CPU_OMP_THREADS_BIND` is `bind` (a core
    list such as "0-3,8|4-7", one part per rank); for "auto", "nobind" or None, the cores the
    worker's parent (vLLM's engine process, which vLLM does not pin) may use."""
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


def run_on(cpus: str) -> None:
    """Move this process to `cpus` (comma-separated core ids) before any thread starts, so
    that every thread has them; one that cannot is said on stderr and stays where it is."""
    try:
        os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
    except (OSError, ValueError) as e:  # it still works, on the inherited cores
        print(f"dualpath side channel: cannot run on cores {cpus} ({e}); staying on "
              f"{sorted(os.sched_getaffinity(0))}", file=sys.stderr, flush=True)
