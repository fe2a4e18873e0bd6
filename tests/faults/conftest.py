"""Fixtures of the fault-injection suite: a small tmpfs to fill up or make read-only."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

Mount = Callable[[int], Path]


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Mount]:
    """`tmpfs(size_bytes)` mounts a fresh tmpfs of that size and returns its folder; all are
    unmounted at the end. Skips the test where mounting is not allowed (not root, or a
    container without CAP_SYS_ADMIN)."""
    mounted: list[Path] = []

    def mount(size_bytes: int) -> Path:
        folder = tmp_path / f"tmpfs{len(mounted)}"
        folder.mkdir()
        if shutil.which("mount") is None:
            pytest.skip("no mount command")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs",
                               str(folder)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
        mounted.append(folder)
        return folder

    try:
        yield mount
    finally:
        for folder in reversed(mounted):
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.fixture
def remount_read_only() -> Callable[[Path], None]:
    """`remount_read_only(folder)` makes a tmpfs of `tmpfs` read-only (skips where it cannot)."""

    def remount(folder: Path) -> None:
        done = subprocess.run(["mount", "-o", "remount,ro", str(folder)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {done.stderr.strip()}")

    return remount
