"""One server in a process group of its own, taken down whole when it ends, whatever ended it.

A vLLM OpenAI server is a tree: the API server, its engine core, the engine's workers, a
multiprocessing resource tracker, and on a decode instance the connector's staging service
(with its own tracker). Killing the API server alone leaves the rest running (seen: 2.5 GB
resident and hundreds of MB of `/dev/shm` after a SIGKILL). So the launcher starts

    python -m dualpath.integrations.vllm.cluster.reaper --tag TAG --parent PID -- CMD...

as the leader of a new session; CMD runs as its child, in its group. The reaper ends the
group when CMD exits (however: a crash, a SIGKILL), when it is sent SIGTERM or SIGINT, or
when its parent, the launcher, dies (`PR_SET_PDEATHSIG`, so even a SIGKILLed launcher):
SIGTERM to every process of the group (vLLM shuts down; the resource trackers ignore it and
unlink what their processes left once those are gone), SIGKILL to what is left after
`--grace` seconds, then the `/dev/shm` sweep (`sweep_shm`): every segment named with the
instance's tag, and every segment a process of the group had mapped or open while it ran
that no live process holds now. It exits with CMD's status (128 + the signal that killed it),
after one line saying what happened, on its stdout (the instance's log).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

SHM = Path("/dev/shm")
TAG_ENV = "DUALPATH_INSTANCE_TAG"
"""The environment variable that gives an instance's processes its tag (the staging service
names its shared memory with it)."""
PR_SET_PDEATHSIG = 1
SCAN_S = 1.0
"""How often the group's shared memory is looked at while the server runs."""


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux
    `prctl(PR_SET_PDEATHSIG)`; kept across exec; nothing elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry.name))
    return out


def shm_in_use(pids: Iterable[int]) -> set[str]:
    """Names of the `/dev/shm` entries that processes `pids` have mapped or open (those
    already unlinked are left out: nothing can sweep them, and their memory goes with the
    last process that holds them)."""
    names: set[str] = set()
    prefix = str(SHM) + "/"
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if path.startswith(prefix) and not path.endswith("(deleted)"):
                    names.add(path[len(prefix):])
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith(prefix) and not target.endswith("(deleted)"):
                        names.add(target[len(prefix):])
    return names


def _all_pids() -> Iterator[int]:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            yield int(entry.name)


def sweep_shm(tag: str, seen: Iterable[str] = ()) -> list[str]:
    """Remove the instance's `/dev/shm` leftovers: every entry with `tag` in its name, and
    each of `seen` (what the group held) that no live process maps or holds open; returns
    the names removed."""
    held = None
    removed = []
    candidates = {p.name for p in SHM.iterdir() if tag and tag in p.name} if SHM.is_dir() \
        else set()
    others = set(seen) - candidates
    if others:
        held = shm_in_use(_all_pids())
        candidates |= {n for n in others if n not in held}
    for name in sorted(candidates):
        with contextlib.suppress(FileNotFoundError):
            (SHM / name).unlink()
            removed.append(name)
    return removed


def take_down(pgid: int, grace_s: float, exclude: int | None = None) -> list[int]:
    """SIGTERM to every process of group `pgid` but `exclude`, SIGKILL to those left after
    `grace_s`, and back once they are gone (a process being killed still maps its memory);
    returns the pids that had to be killed."""

    def left() -> list[int]:
        return [p for p in group_members(pgid) if p != exclude]

    for pid in left():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not left():
            return []
        time.sleep(0.1)
    killed = left()
    # The resource trackers last: once the processes they serve are gone, they unlink what
    # those left (they ignore SIGTERM and exit by themselves).
    trackers = [p for p in killed if _is_resource_tracker(p)]
    for pid in killed:
        if pid not in trackers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        rest = left()
        if not rest:
            break
        if set(rest) <= set(trackers) and time.monotonic() > deadline - 8.0:
            for pid in rest:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    return killed


def _is_resource_tracker(pid: int) -> bool:
    """Whether `pid` is a Python multiprocessing resource tracker."""
    try:
        return b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def describe_status(code: int) -> str:
    """A process's exit status in words (negative or above 128: a signal)."""
    sig = -code if code < 0 else code - 128 if code > 128 else 0
    if sig:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(sig).name}"
        return f"killed by signal {sig}"
    return f"exited with {code}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="run CMD in this process group and take the "
                                 "whole group down with it (dualpath vllm up)")
    ap.add_argument("--tag", required=True, help="the instance's tag (its shared memory is "
                    "named with it; given to CMD's processes as $" + TAG_ENV + ")")
    ap.add_argument("--parent", type=int, help="end when this process is gone")
    ap.add_argument("--grace", type=float, default=10.0, help="seconds from SIGTERM to "
                    "SIGKILL (default: %(default)s)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("no command after --")
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda s, f: stopping.append(s))
    signal.signal(signal.SIGINT, lambda s, f: stopping.append(s))
    die_with_parent(signal.SIGTERM)
    if args.parent is not None and os.getppid() != args.parent:
        return 1  # the launcher died before the line above
    pgid = os.getpgrp()
    child = subprocess.Popen(cmd, env={**os.environ, TAG_ENV: args.tag})
    seen: set[str] = set()
    next_scan = 0.0
    while child.poll() is None and not stopping:
        if time.monotonic() >= next_scan:
            seen |= shm_in_use(group_members(pgid))
            next_scan = time.monotonic() + SCAN_S
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(0.2)
    seen |= shm_in_use(group_members(pgid))
    why = f"stopped by {signal.Signals(stopping[0]).name}" if stopping and \
        child.poll() is None else f"server {describe_status(child.poll() or 0)}"
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    killed = take_down(pgid, args.grace, exclude=os.getpid())
    code = child.wait()
    removed = sweep_shm(args.tag, seen)
    print(f"dualpath reaper [{args.tag}]: {why}; its process group is down"
          + (f" ({len(killed)} SIGKILLed after {args.grace:g} s)" if killed else "")
          + (f"; removed /dev/shm/{', '.join(removed)}" if removed else ""), flush=True)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
