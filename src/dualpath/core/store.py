"""`BlockStore`: Full Blocks on a filesystem path, keyed by prefix-chained block keys.

Layout (under `root`, which may be a local folder or a 3FS / NFS mount; all engine processes of
all nodes open the same root):

    root/store.json                    {"format": ..., "full_block_bytes": N}; fixed per store
    root/<kk>/<key hex>.blk            one file per Full Block; <kk> = first key byte (256 dirs)
    root/.tmp/.tmp-<key hex>-<host>-<pid>-<n>   a write in progress (never read); <host> is a
                                       tag of the writer's host name, <n> unique in its process

    .blk file = header (64 B) + payload (full_block_bytes B)
    header    = magic "DPKVBLK1" | version u16 | key length u16 | payload bytes u64 |
                payload crc32c u32 | header crc32c u32 | key (32 B, zero padded) | pad

Why one file per Full Block: storage I/O always moves whole Full Blocks (paper §4.1), so a
block is read with one `open` + one `preadv` of a contiguous extent (header and payload land in
preallocated buffers in one system call; a block over `READ_CHUNK_BYTES`, one `preadv` per
piece, each checksummed while in the caches). Files per Layer Block would multiply the file
count and the per-read open/metadata cost by `num_layers` (30 for SmolLM2) for no benefit, since
no reader ever wants a single layer from storage. A Full Block is `num_layers * block_size *
kv_bytes_per_token_per_layer` (2.9 MB for SmolLM2 in fp32 at 64 tokens), well above the size
where per-file overhead matters. One file per block (rather than append-only segments) keeps
writers on different nodes independent: there is no shared index to update, a block becomes
visible to every reader the moment its rename lands, and the filesystem is the index, so
`contains` is a `stat`.

Atomicity: `put` writes a temp file in the store's one temp folder, fsyncs it (when
`is_durable`), then `os.replace`s it onto the final name (a rename within one file system,
which POSIX makes atomic). A writer killed at any point leaves at most a `.tmp-*` file,
which readers never open; the final name only ever refers to a complete file.
The first open of a store root in a process removes the temp files of writers on this host
that are no longer running (and any older than an hour). Temps live in `.tmp/` so that this
sweep lists one small folder, not the 256 block folders and every block in them (on a
network file system, pages of entries fetched one round trip at a time, by every worker,
side channel and router that opens the store); the open that creates `.tmp/` walks the
block folders once, for temps that earlier versions left beside the blocks. A put that
fails (a full disk, a read-only mount) removes its temp file, is counted in
`num_failed_puts` and raises; callers that persist KV in the background count it and carry
on (the block is a later cache miss).

Capacity (optional, `capacity_bytes`): the store keeps about that many bytes of block files
and evicts whole blocks, least recently used first (the later of a file's atime and mtime; a
hit refreshes the atime once a minute, whatever the mount's atime policy), down to
`EVICT_TO` of it. A writer keeps an estimate (the last scan's total plus what it wrote since)
and scans the store when that passes the capacity; blocks other processes write count from
its next scan, so several writers together may pass the capacity for a while. A write in
progress is a temp file, never evicted, and a put never evicts the block it just wrote. An
evicted block is a later miss (recompute), and a reader that has it open reads it whole.

Integrity: every read checks the magic, the key, the size and the CRC32C of the payload (the
SSE4.2 instruction, ~15 GB/s, so verification costs a few percent of a read); a block
that fails is counted as corrupt, removed, and reported as a miss, so the caller recomputes it
and a later `put` rewrites it. Whatever else sits at a block's path and cannot be read (a
directory, a FIFO, a file without read permission, an I/O error) is counted as unreadable and
reported as a miss. Nothing is lost: a miss only costs recompute. `docs/reliability.md` has
the whole list of promises and the tests that hold them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c

from dualpath.core.blocks import longest_prefix as _longest_prefix
from dualpath.core.errors import DualPathError
from dualpath.core.validate import positive_int

FORMAT = "dualpath-blockstore-v1"
MAGIC = b"DPKVBLK1"
VERSION = 1
MAX_KEY_BYTES = 32
HEADER_BYTES = 64
_FIXED = struct.Struct("<8sHHQI")  # magic, version, key length, payload bytes, payload crc32c
_HEADER_CRC = struct.Struct("<I")
# Header: fixed fields (24 B) | header crc32c (4 B) | key (32 B) | zero pad (4 B) = 64 B.
_KEY_OFFSET = _FIXED.size + _HEADER_CRC.size
assert _KEY_OFFSET + MAX_KEY_BYTES <= HEADER_BYTES
STALE_TEMP_AGE_S = 3600.0
"""A temp file older than this is stale whoever wrote it (no put takes an hour)."""
_HOST_TAG = f"{crc32c.crc32c(socket.gethostname().encode()):08x}"
"""Which host a temp file's pid belongs to (host names may hold `-`; the tag never does)."""
_TMP_IDS = itertools.count()
"""Per process, not per store: two stores of one process (nodes launched as threads) writing
the same key must not pick the same temp name."""
_SWEPT_ROOTS: set[str] = set()
"""Store roots (real paths) whose stale temps this process has swept."""
_SWEPT_LOCK = threading.Lock()
TEMP_DIR = ".tmp"
"""The folder under a store root where every write in progress lives."""
EVICT_TO = 0.9
"""A store over its capacity evicts down to this fraction of it (so a scan is rare)."""
CRC_RELEASE_GIL_BYTES = int(os.environ.get("DUALPATH_CRC_RELEASE_GIL_BYTES", 256 * 1024))
"""A buffer at least this large is checksummed with the GIL released (other threads run
meanwhile); a smaller one holds it (`DUALPATH_CRC_RELEASE_GIL_BYTES` overrides it). On this
2-core VM, releasing it per 64 KiB page (a 16-token block's page of a 70B rank) cost three
times the CPU of the checksum itself with 16 reader threads (each call then waits for the GIL
back): 3.3 GB per CPU-second against 9.1 held."""
READ_CHUNK_BYTES = 4 << 20
"""`get_into` reads a block this many payload bytes at a time and checksums each piece
right after its read, while it is still in the CPU's caches (one `preadv` per piece): a
32 MiB file read whole and then checksummed took about 20% more CPU per byte here (2-core
EPYC, 32 MiB L3) than in 4 MiB pieces. Blocks up to this size are one `preadv`."""
TOUCH_AFTER_S = 60.0
"""A hit on a block whose atime is older than this sets it to now (LRU recency)."""


class StoreError(DualPathError):
    """The store root is unusable (wrong block size, unreadable metadata, bad key)."""


@dataclass
class StoreCounters:
    """What this process's `BlockStore` has done since it was opened (not shared)."""

    num_hits: int = 0
    num_misses: int = 0
    """Lookups of a key with no stored block."""
    num_corrupt: int = 0
    """Lookups that found a block failing verification (served as a miss, then removed)."""
    num_unreadable: int = 0
    """Lookups whose path could not be read (a directory, a FIFO, no permission, an I/O
    error; served as a miss, left in place: a later put replaces it where it can)."""
    num_puts: int = 0
    num_skipped_puts: int = 0
    """`put(..., overwrite=False)` calls that found the block already stored."""
    num_failed_puts: int = 0
    """Puts that raised OSError (a full disk, a read-only store); nothing was stored."""
    num_stale_temps_removed: int = 0
    """Temp files of dead writers removed when the store was opened."""
    num_evicted: int = 0
    """Blocks removed to keep the store within its capacity."""
    num_capacity_scans: int = 0
    read_bytes: int = 0
    written_bytes: int = 0

    @property
    def num_lookups(self) -> int:
        return self.num_hits + self.num_misses + self.num_corrupt + self.num_unreadable


def _encode_header(key: bytes, payload_bytes: int, payload_crc: int) -> bytes:
    fixed = _FIXED.pack(MAGIC, VERSION, len(key), payload_bytes, payload_crc)
    key_field = key.ljust(MAX_KEY_BYTES, b"\0")
    header_crc = crc32c.crc32c(key_field, crc32c.crc32c(fixed))
    head = fixed + _HEADER_CRC.pack(header_crc) + key_field
    return head.ljust(HEADER_BYTES, b"\0")


def _check_header(header: bytes | bytearray, key: bytes, payload_bytes: int) -> int | None:
    """The payload CRC the header promises, or None when the header is not valid for `key`."""
    magic, version, key_len, size, payload_crc = _FIXED.unpack_from(header, 0)
    (header_crc,) = _HEADER_CRC.unpack_from(header, _FIXED.size)
    mv = memoryview(header)
    key_field = mv[_KEY_OFFSET : _KEY_OFFSET + MAX_KEY_BYTES]
    if crc32c.crc32c(key_field, crc32c.crc32c(mv[: _FIXED.size])) != header_crc:
        return None
    if magic != MAGIC or version != VERSION or size != payload_bytes:
        return None
    if key_len != len(key) or key_field[:key_len] != key:
        return None
    if any(mv[_KEY_OFFSET + MAX_KEY_BYTES :]):  # the pad is zero: every header byte is checked
        return None
    return int(payload_crc)


class BlockStore:
    """Full Blocks of one fixed size on a filesystem path.

    Safe to use from many processes (and machines sharing the mount) at once; one instance is
    not thread-safe (its counters are plain integers).
    """

    def __init__(self, root: Path | str, full_block_bytes: int, *, is_durable: bool = True,
                 capacity_bytes: int | None = None) -> None:
        """Open (creating if needed) the store at `root` for blocks of `full_block_bytes`.

        `is_durable=False` skips fsync: writes are still atomic against a process crash (the
        page cache survives it) but not against a power loss; meant for tests and benches.
        `capacity_bytes`: evict least recently used blocks beyond about that many bytes of
        block files (None: keep every block). Raises StoreError if `root` already holds
        blocks of another size.
        """
        positive_int("blockstore", "full_block_bytes", full_block_bytes)
        if capacity_bytes is not None:
            positive_int("blockstore", "capacity_bytes", capacity_bytes)
        self.root = Path(root)
        self._root_str = os.fspath(self.root)
        self.full_block_bytes = full_block_bytes
        self.is_durable = is_durable
        self.capacity_bytes = capacity_bytes
        self._stored_bytes: int | None = None
        """Bytes of block files: the last capacity scan's total plus this store's puts since
        (None: not scanned yet)."""
        self.counters = StoreCounters()
        self._open_meta()
        self._temp_dir = f"{self._root_str}/{TEMP_DIR}"
        try:
            os.mkdir(self._temp_dir)
            is_new_temp_dir = True
        except OSError:  # there already (or a read-only store: puts fail and are counted)
            is_new_temp_dir = False
        if _first_open_here(self._root_str) or is_new_temp_dir:
            self.counters.num_stale_temps_removed = self.remove_stale_temp(
                in_block_folders=is_new_temp_dir)

    # -- metadata --------------------------------------------------------------------------
    def _open_meta(self) -> None:
        meta_path = self.root / "store.json"
        want: dict[str, Any] = {"format": FORMAT, "full_block_bytes": self.full_block_bytes}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"{self.root}: cannot create store root ({exc.strerror})") from None
        if not meta_path.exists():
            try:
                self._create_meta(meta_path, want)
            except OSError as exc:
                raise StoreError(
                    f"{meta_path}: cannot create store metadata ({exc.strerror})"
                ) from None
        try:
            have = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise StoreError(f"{meta_path}: unreadable store metadata ({exc})") from None
        if not isinstance(have, dict) or have.get("format") != FORMAT:
            raise StoreError(f"{meta_path}: format={have.get('format')!r}, expected {FORMAT!r}"
                             if isinstance(have, dict) else f"{meta_path}: not a JSON object")
        if have.get("full_block_bytes") != self.full_block_bytes:
            raise StoreError(
                f"{meta_path}: full_block_bytes={have.get('full_block_bytes')!r}, but this "
                f"store was opened for {self.full_block_bytes}"
            )

    def _create_meta(self, meta_path: Path, want: dict[str, Any]) -> None:
        # A fresh file per caller: threads of one process share a pid, and rewriting a
        # shared temp name would truncate the inode already linked as store.json.
        fd, tmp_name = tempfile.mkstemp(prefix=".tmp-store.json-", dir=self.root)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(want) + "\n")
            # Another process may win the race; os.link fails if it did, and we then read
            # (and check) its metadata instead of overwriting it.
            try:
                os.link(tmp, meta_path)
            except FileExistsError:
                pass
            except OSError:  # no hard links (some FUSE mounts): a rename is atomic too
                if not meta_path.exists():
                    os.replace(tmp, meta_path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    # -- paths -----------------------------------------------------------------------------
    def path_of(self, key: bytes) -> Path:
        """Where the block of `key` lives (it may not exist)."""
        return Path(self._path_str(key))

    def _path_str(self, key: bytes) -> str:
        # Plain string joins: this runs once per block read, where pathlib costs microseconds.
        self._check_key(key)
        hex_key = key.hex()
        return f"{self._root_str}/{hex_key[:2]}/{hex_key}.blk"

    @staticmethod
    def _check_key(key: bytes) -> None:
        if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY_BYTES:
            raise StoreError(f"block key must be 1..{MAX_KEY_BYTES} bytes, got {key!r}")

    @property
    def file_bytes(self) -> int:
        """Bytes one block occupies on disk (header + payload)."""
        return HEADER_BYTES + self.full_block_bytes

    # -- write -----------------------------------------------------------------------------
    def put(self, key: bytes, data: memoryview | bytes | bytearray, *, overwrite: bool = True
            ) -> bool:
        """Store `data` (exactly `full_block_bytes`) as the block of `key`, atomically.

        Returns False (and writes nothing) when `overwrite` is False and the block exists.
        Keys are content-addressed (prefix-chained hashes of the tokens), so skipping an
        existing block is safe; a corrupt one is removed on read and rewritten by the next put.
        """
        path = self.path_of(key)
        mv = memoryview(data).cast("B")
        if mv.nbytes != self.full_block_bytes:
            raise StoreError(
                f"put {key.hex()}: data has {mv.nbytes} bytes, store holds {self.full_block_bytes}"
            )
        if not overwrite and path.exists():
            self.counters.num_skipped_puts += 1
            return False
        header = _encode_header(key, mv.nbytes, crc32c.crc32c(mv))
        tmp = ""
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = _create_temp(self._temp_dir, path.stem)
            try:
                _write_all(fd, [header, mv])
                if self.is_durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            # Invariant: the final name is bound only to complete, checksummed files.
            os.replace(tmp, path)
        except BaseException as exc:
            if tmp:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            if isinstance(exc, OSError):
                self.counters.num_failed_puts += 1
            raise
        if self.is_durable:
            _fsync_dir(path.parent)
        self.counters.num_puts += 1
        self.counters.written_bytes += self.file_bytes
        if self.capacity_bytes is not None:
            if self._stored_bytes is not None and \
                    self._stored_bytes + self.file_bytes <= self.capacity_bytes:
                self._stored_bytes += self.file_bytes
            else:
                self.evict(keep=os.fspath(path))
        return True

    def evict(self, keep: str = "") -> int:
        """Scan the store and, past `capacity_bytes`, remove the least recently used block
        files (never `keep`, the path of a block just written) down to `EVICT_TO` of it;
        returns how many. Without a capacity, nothing."""
        if self.capacity_bytes is None:
            return 0
        self.counters.num_capacity_scans += 1
        blocks = []
        total = 0
        with contextlib.suppress(OSError):
            for folder in os.scandir(self._root_str):
                if len(folder.name) != 2 or not folder.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(OSError), os.scandir(folder.path) as entries:
                    for entry in entries:
                        if not entry.name.endswith(".blk") or entry.name.startswith("."):
                            continue
                        with contextlib.suppress(OSError):
                            st = entry.stat(follow_symlinks=False)
                            total += st.st_size
                            blocks.append((max(st.st_atime, st.st_mtime), st.st_size,
                                           entry.path))
        removed = 0
        if total > self.capacity_bytes:
            target = int(self.capacity_bytes * EVICT_TO)
            blocks.sort()
            for _, size, path in blocks:
                if total <= target:
                    break
                if path == keep:
                    continue
                try:
                    os.unlink(path)
                    removed += 1
                except FileNotFoundError:  # another process evicted it: gone all the same
                    pass
                except OSError:
                    continue
                total -= size
        self.counters.num_evicted += removed
        self._stored_bytes = total
        return removed

    # -- read ------------------------------------------------------------------------------
    def get_into(self, key: bytes, out: Any) -> bool:
        """Read the block of `key` into `out`: a writable buffer of `full_block_bytes`, or a
        list of writable buffers filled in order that total that (a scatter read: e.g. each
        layer's page straight into its place in a paged KV cache, with no staging copy).

        Returns True on a verified hit. Returns False on a miss or a corrupt block (counted in
        `counters`); `out` then holds unspecified bytes and must not be used.
        """
        path = self._path_str(key)
        views = [memoryview(b).cast("B") for b in (out if isinstance(out, list) else [out])]
        nbytes = sum(v.nbytes for v in views)
        if any(v.readonly for v in views) or nbytes != self.full_block_bytes:
            raise StoreError(
                f"get_into {key.hex()}: out must be writable buffers of "
                f"{self.full_block_bytes} bytes, got {nbytes} "
                f"(readonly={any(v.readonly for v in views)})"
            )
        try:
            # O_NONBLOCK: a FIFO planted at the path opens at once (and then fails to read)
            # instead of blocking the reader forever; regular files ignore it.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            self.counters.num_misses += 1
            return False
        except OSError:  # no permission, a symlink loop, a path through a file, ...
            self.counters.num_unreadable += 1
            return False
        header = bytearray(HEADER_BYTES)
        got = 0
        crc = 0
        try:
            for n, piece in enumerate(_pieces(views, READ_CHUNK_BYTES)):
                want = sum(v.nbytes for v in piece)
                got_now = _preadv_all(fd, [header, *piece] if n == 0 else piece, got)
                got += got_now
                if got_now < want + (HEADER_BYTES if n == 0 else 0):
                    break  # a short file: not a block
                for v in piece:  # while it is in the caches
                    crc = crc32c.crc32c(v, crc, gil_release_mode=int(
                        v.nbytes >= CRC_RELEASE_GIL_BYTES))
            if self.capacity_bytes is not None:
                _touch(fd)
        except OSError:  # a directory (EISDIR), a FIFO (ESPIPE), an I/O error
            self.counters.num_unreadable += 1
            return False
        finally:
            os.close(fd)
        payload_crc = None
        if got == self.file_bytes:
            payload_crc = _check_header(header, key, self.full_block_bytes)
        if payload_crc is None or crc != payload_crc:
            self._quarantine(path)
            return False
        self.counters.num_hits += 1
        self.counters.read_bytes += self.file_bytes
        return True

    def _quarantine(self, path: str) -> None:
        """Count a corrupt block and remove it so it is recomputed and rewritten."""
        self.counters.num_corrupt += 1
        # A concurrent put may have just replaced it with a good file; removing that one only
        # costs a future miss, never a wrong read.
        with contextlib.suppress(OSError):
            os.unlink(path)

    def contains(self, key: bytes) -> bool:
        """Whether a block of `key` is stored (a `stat`; contents are verified on read)."""
        return os.path.exists(self._path_str(key))

    def longest_prefix(self, keys: Iterable[bytes]) -> int:
        """Number of leading `keys` whose blocks are stored (the hit length in blocks)."""
        return _longest_prefix(keys, self.contains)

    def remove(self, key: bytes) -> bool:
        """Delete the block of `key`; False if it was not stored."""
        try:
            os.unlink(self.path_of(key))
        except FileNotFoundError:
            return False
        return True

    def remove_stale_temp(self, max_age_s: float = STALE_TEMP_AGE_S, *,
                          in_block_folders: bool = False) -> int:
        """Delete the `.tmp-*` files killed writers left in the temp folder (and, with
        `in_block_folders`, beside the blocks, where earlier versions wrote them: a walk of
        the whole store); returns how many.

        A temp file is stale when its writer ran on this host and that process is gone, or
        when it is older than `max_age_s` (writers on other hosts sharing the mount, names
        of other formats). Temps of this process and of live processes are kept: they may be
        writes in progress. Runs when a store is opened; errors (a read-only store) are
        ignored, as a stale temp costs only its disk space.
        """
        now = time.time()
        removed = 0
        temps: Iterable[Path] = self.root.glob(f"{TEMP_DIR}/.tmp-*")
        if in_block_folders:
            temps = itertools.chain(temps, self.root.glob("[0-9a-f][0-9a-f]/.tmp-*"))
        for tmp in temps:
            with contextlib.suppress(OSError):
                if _is_dead_local_writer(tmp.name) or now - tmp.stat().st_mtime > max_age_s:
                    tmp.unlink()
                    removed += 1
        return removed

    def keys(self) -> list[bytes]:
        """Keys of all stored blocks (a directory walk; for tools and tests)."""
        return [bytes.fromhex(p.stem) for p in sorted(self.root.glob("*/*.blk"))]


def _first_open_here(root: str) -> bool:
    """Whether this is the process's first open of store `root` (then it sweeps)."""
    real = os.path.realpath(root)
    with _SWEPT_LOCK:
        if real in _SWEPT_ROOTS:
            return False
        _SWEPT_ROOTS.add(real)
        return True


def _touch(fd: int) -> None:
    """Mark an open block as used now (its atime), at most once per `TOUCH_AFTER_S`."""
    st = os.fstat(fd)
    now_ns = time.time_ns()
    if now_ns - st.st_atime_ns > TOUCH_AFTER_S * 1e9:
        with contextlib.suppress(OSError):  # a read-only store: recency is only a hint
            os.utime(fd, ns=(now_ns, st.st_mtime_ns))


def _create_temp(folder: str, stem: str) -> tuple[int, str]:
    """A new temp file in `folder` for the block file named `stem`, opened for writing:
    `(fd, name)`.

    The name says who writes it (host tag, pid), so a later open can tell a dead writer's
    leftovers from a live one's; a name taken already (a pid reused since a crash) is skipped.
    """
    while True:
        name = f"{folder}/.tmp-{stem}-{_HOST_TAG}-{os.getpid()}-{next(_TMP_IDS)}"
        try:
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), name
        except FileExistsError:
            continue
        except FileNotFoundError:  # the temp folder was removed while the store was open
            os.makedirs(folder, exist_ok=True)


def _is_dead_local_writer(name: str) -> bool:
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


def _write_all(fd: int, buffers: list[Any]) -> None:
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


def _pieces(views: list[memoryview], size: int) -> list[list[memoryview]]:
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


def _preadv_all(fd: int, buffers: list[Any], offset: int = 0) -> int:
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


def _fsync_dir(path: Path) -> None:
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
