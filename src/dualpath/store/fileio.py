"""The store's file I/O: temp files named by their writer, whole writes and scatter reads,
durable renames, recency marks. No policy: `BlockStore` decides what to write and read."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import crc32c

_HOST_TAG = f"{crc32c.crc32c(socket.gethostname().encode()):08x}"
"""Which host a temp file's pid belongs to (host names may hold `-`; the tag never does)."""
_TMP_IDS = itertools.count()
"""Per process, not per store: two stores of one process (nodes launched as threads) writing
the same key must not pick the same temp name."""
_SWEPT_ROOTS: set[str] = set()
"""Store roots (real paths) whose stale temps this process has swept."""
_SWEPT_LOCK = threading.Lock()
TOUCH_AFTER_S = 60.0
"""A hit on a block whose atime is older than this sets it to now (LRU recency)."""


def first_open_here(root: str) -> bool:
    """Whether this is the process's first open of store `root` (then it sweeps)."""
    real = os.path.realpath(root)
    with _SWEPT_LOCK:
        if real in _SWEPT_ROOTS:
            return False
        _SWEPT_ROOTS.add(real)
        return True


def touch(fd: int) -> None:
    """Mark an open block as used now (its atime), at most once per `TOUCH_AFTER_S`."""
    st = os.fstat(fd)
    now_ns = time.time_ns()
    if now_ns - st.st_atime_ns > TOUCH_AFTER_S * 1e9:
        with contextlib.suppress(OSError):  # a read-only store: recency is only a hint
            os.utime(fd, ns=(now_ns, st.st_mtime_ns))


def create_temp(folder: str, stem: str, mode: int) -> tuple[int, str]:
    """A new temp file of permission bits `mode` in `folder` for the block file named `stem`,
    opened for writing: `(fd, name)`.

    The name says who writes it (host tag, pid), so a later open can tell a dead writer's
    leftovers from a live one's; a name taken already (a pid reused since a crash) is skipped.
    """
    while True:
        name = f"{folder}/.tmp-{stem}-{_HOST_TAG}-{os.getpid()}-{next(_TMP_IDS)}"
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            continue
        except FileNotFoundError:  # the temp folder was removed while the store was open
            os.makedirs(folder, mode=0o700, exist_ok=True)
            continue
        if mode & ~0o600:  # wider than owner-only: the umask must not narrow it
            os.fchmod(fd, mode)
        return fd, name


def is_dead_local_writer(name: str) -> bool:
    """Whether temp file `name` was written by a process of this host that has exited."""
    parts = name.split("-")  # ".tmp", key hex, host tag, pid, n
    if len(parts) != 5 or parts[2] != _HOST_TAG or not parts[3].isdigit():
        return False
    pid = int(parts[3])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: alive, another user's
        return False
    return False


def write_all(fd: int, buffers: list[Any]) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


MAX_IOVECS = 512
"""Buffers per `preadv` at most (Linux refuses more than IOV_MAX, 1024, with EINVAL)."""


def pieces(views: list[memoryview], size: int) -> list[list[memoryview]]:
    """`views` in order, in runs of about `size` bytes (a run closes once it holds `size`,
    or `MAX_IOVECS - 1` buffers, room left for a header; a larger view is cut in `size`
    pieces)."""
    runs: list[list[memoryview]] = [[]]
    held = 0
    for v in views:
        for lo in range(0, max(v.nbytes, 1), size):
            runs[-1].append(v[lo:lo + size])
            held += min(size, v.nbytes - lo)
            if held >= size or len(runs[-1]) >= MAX_IOVECS - 1:
                runs.append([])
                held = 0
    return [run for run in runs if run] or [[]]


def preadv_all(fd: int, buffers: list[Any], offset: int = 0) -> int:
    """preadv from `offset` until the buffers are full or the file ends; returns the bytes
    read."""
    views = [memoryview(b).cast("B") for b in buffers]
    total = 0
    while views:
        n = os.preadv(fd, views, offset + total)
        if n == 0:
            break
        total += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
