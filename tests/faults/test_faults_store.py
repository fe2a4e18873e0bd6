"""The block store under faults: writers killed with SIGKILL mid-block, every kind of damaged
or foreign file at a block's path, a full disk, a read-only mount. Each test ends with nothing
lost: every block reads back as written, or is a counted miss."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from dualpath.core.blocks import block_keys
from dualpath.store import HEADER_BYTES, BlockStore, StoreError

BLOCK_BYTES = 4096
Mount = Callable[[int], Path]
"""The `tmpfs` fixture: mount a tmpfs of this many bytes, get its folder."""


def payload(seed: int, nbytes: int = BLOCK_BYTES) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def check_nothing_lost(store: BlockStore, written: dict[bytes, bytes]) -> int:
    """Every block of `written` reads back as written or is a miss that `store` counted;
    returns the number of misses."""
    before = store.counters.num_lookups - store.counters.num_hits
    out = bytearray(store.full_block_bytes)
    num_missed = 0
    for key, data in written.items():
        if store.get_into(key, out):
            assert bytes(out) == data, f"block {key.hex()} read back different bytes"
        else:
            num_missed += 1
    assert store.counters.num_lookups - store.counters.num_hits - before == num_missed
    return num_missed


# -- kill -9 of writers ----------------------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from dualpath.store import BlockStore
    root, nbytes = sys.argv[1], int(sys.argv[2])
    store = BlockStore(root, nbytes, is_durable=True)
    base = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    i = 0
    while True:
        base[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
        store.put(i.to_bytes(16, "little"), memoryview(base))
        if i == 0:
            print("started", flush=True)
        i += 1
    """
)


def written_by_writer(key: bytes, nbytes: int) -> bytes:
    """What WRITER stores under `key`."""
    base = bytearray(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes())
    base[:8] = key[:8]
    return bytes(base)


def test_writers_killed_mid_block_leave_only_whole_blocks_and_no_temps(tmp_path: Path) -> None:
    nbytes = 1 << 20  # big enough that most kills land inside a write
    rng = random.Random(1234)
    num_left = 0
    for num_kills in range(1, 31):  # at least 8 kills, more until one landed inside a write
        if num_kills > 8 and num_left:
            break
        # Each writer's open sweeps the temps the previous killed writer left.
        child = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(nbytes)], stdout=subprocess.PIPE
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"started"
        assert not [t for t in tmp_path.glob("*/.tmp-*") if f"-{child.pid}-" not in t.name]
        assert not list(tmp_path.glob("[0-9a-f][0-9a-f]/.tmp-*"))  # one temp folder only
        time.sleep(rng.uniform(0.02, 0.3))
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert child.returncode == -signal.SIGKILL
        left = list(tmp_path.glob(".tmp/.tmp-*"))
        for tmp in left:  # partial writes exist only under temp names readers never open
            assert tmp.stat().st_size <= HEADER_BYTES + nbytes
        num_left += len(left)
    assert num_left, "no kill landed inside a write"
    left = list(tmp_path.glob("*/.tmp-*"))
    store = BlockStore(tmp_path, nbytes, is_durable=False)
    assert store.counters.num_stale_temps_removed == len(left)
    assert not list(tmp_path.glob("*/.tmp-*"))
    keys = store.keys()
    assert keys, "the writers stored nothing before being killed"
    assert check_nothing_lost(store, {k: written_by_writer(k, nbytes) for k in keys}) == 0


# -- damaged or foreign files at a block's path -------------------------------------------------

def _flip_payload(path: Path, other: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 100] ^= 0x01
    path.write_bytes(raw)


def _flip_header(path: Path, other: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[9] ^= 0x80  # the version field
    path.write_bytes(raw)


def _truncate(path: Path, other: Path) -> None:
    path.write_bytes(path.read_bytes()[: HEADER_BYTES + BLOCK_BYTES // 3])


def _empty(path: Path, other: Path) -> None:
    path.write_bytes(b"")


def _extend(path: Path, other: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0" * 16)


def _swap(path: Path, other: Path) -> None:  # a valid block of another key
    path.write_bytes(other.read_bytes())


def _symlink_to_other(path: Path, other: Path) -> None:
    path.unlink()
    path.symlink_to(other)


def _dangling_symlink(path: Path, other: Path) -> None:
    path.unlink()
    path.symlink_to(path.parent / "nothing-here")


def _symlink_loop(path: Path, other: Path) -> None:
    path.unlink()
    path.symlink_to(path)


def _directory(path: Path, other: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "inside").write_bytes(b"x")


def _fifo(path: Path, other: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _parent_is_a_file(path: Path, other: Path) -> None:
    for blk in path.parent.iterdir():
        blk.unlink()
    path.parent.rmdir()
    path.parent.write_bytes(b"not a folder")


def _unreadable(path: Path, other: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads files without read permission")
    path.chmod(0)


DAMAGE: dict[str, Callable[[Path, Path], None]] = {
    "flipped payload byte": _flip_payload,
    "flipped header byte": _flip_header,
    "truncated": _truncate,
    "empty": _empty,
    "extended": _extend,
    "swapped with another key's block": _swap,
    "symlink to another block": _symlink_to_other,
    "dangling symlink": _dangling_symlink,
    "symlink loop": _symlink_loop,
    "directory": _directory,
    "fifo": _fifo,
    "parent folder is a file": _parent_is_a_file,
    "no read permission": _unreadable,
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_every_damaged_block_is_a_counted_miss_and_rewritable(tmp_path: Path, kind: str) -> None:
    store = BlockStore(tmp_path, BLOCK_BYTES, is_durable=False)
    keys = block_keys(list(range(64 * 12)), 64)
    written = {k: payload(i) for i, k in enumerate(keys)}
    for k, data in written.items():
        store.put(k, data)
    victim = keys[3]
    # Another key in another folder (keys are hashes: folders differ unless by chance).
    other = next(k for k in keys if k[:1] != victim[:1])
    DAMAGE[kind](store.path_of(victim), store.path_of(other))
    num_missed = check_nothing_lost(store, written)
    # Bytes past the end change nothing a read returns: that block is still a verified hit.
    # Replacing a folder by a file loses every block in it (all counted misses).
    assert num_missed >= 1 or kind == "extended"
    # Repair: a put replaces what is there, or fails and is counted (a directory stays).
    out = bytearray(BLOCK_BYTES)
    try:
        store.put(victim, written[victim])
    except OSError:
        assert store.counters.num_failed_puts == 1
        assert not store.get_into(victim, out)
    else:
        assert store.get_into(victim, out) and bytes(out) == written[victim]
    assert not list(tmp_path.glob("*/.tmp-*"))
    assert check_nothing_lost(store, {k: d for k, d in written.items() if k != victim}) == 0


# -- a full disk and a read-only store ---------------------------------------------------------

def test_a_full_disk_fails_puts_cleanly_and_counted(tmpfs: Mount) -> None:
    root = tmpfs(1 << 20)
    nbytes = 64 * 1024
    store = BlockStore(root / "store", nbytes, is_durable=True)
    written: dict[bytes, bytes] = {}
    num_failed = 0
    for i in range(40):  # about 15 fit
        key, data = i.to_bytes(16, "little"), payload(i, nbytes)
        try:
            store.put(key, data)
        except OSError as exc:
            assert exc.errno == 28  # ENOSPC
            num_failed += 1
        written[key] = data
    assert num_failed > 0 and store.counters.num_failed_puts == num_failed
    assert store.counters.num_puts == 40 - num_failed
    assert not list(root.glob("store/*/.tmp-*"))  # a failed put leaves no temp behind
    assert check_nothing_lost(store, written) == num_failed
    # Space freed: persistence works again.
    for key in store.keys()[:4]:
        store.remove(key)
    missing = [k for k in written if not store.contains(k)]
    store.put(missing[0], written[missing[0]])
    assert store.get_into(missing[0], bytearray(nbytes))


def test_a_read_only_store_serves_reads_and_counts_failed_puts(
    tmpfs: Mount, remount_read_only: Callable[[Path], None]
) -> None:
    root = tmpfs(4 << 20)
    store = BlockStore(root / "store", BLOCK_BYTES, is_durable=False)
    keys = block_keys(list(range(64 * 6)), 64)
    written = {k: payload(i) for i, k in enumerate(keys)}
    for k in keys[:4]:
        store.put(k, written[k])
    dead = root / "store" / ".tmp" / ".tmp-left-by-a-crash"
    dead.write_bytes(b"partial")
    old = time.time() - 7200
    os.utime(dead, (old, old))
    remount_read_only(root)
    reopened = BlockStore(root / "store", BLOCK_BYTES, is_durable=False)  # sweep fails quietly
    assert reopened.counters.num_stale_temps_removed == 0 and dead.exists()
    with pytest.raises(OSError):
        reopened.put(keys[4], written[keys[4]])
    assert reopened.counters.num_failed_puts == 1
    assert check_nothing_lost(reopened, written) == 2  # the two never stored
    with pytest.raises(StoreError, match=r"cannot create store root \(Read-only file system\)"):
        BlockStore(root / "fresh", BLOCK_BYTES)
