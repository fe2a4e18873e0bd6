"""`BlockStore`: Full Blocks on a filesystem path, keyed by prefix-chained block keys.

Layout (under `root`, which may be a local folder or a 3FS / NFS mount; all engine processes of
all nodes open the same root):

    root/store.json                    {"format": ..., "full_block_bytes": N}; fixed per store
    root/<kk>/<key hex>.blk            one file per Full Block; <kk> = first key byte (256 dirs)
    root/<kk>/.tmp-<key hex>-<pid>-<n> a write in progress (never read)

    .blk file = header (64 B) + payload (full_block_bytes B)
    header    = magic "DPKVBLK1" | version u16 | key length u16 | payload bytes u64 |
                payload crc32c u32 | header crc32c u32 | key (32 B, zero padded) | pad

Why one file per Full Block: storage I/O always moves whole Full Blocks (paper §4.1), so a
block is read with one `open` + one `preadv` of a contiguous extent (header and payload land in
two preallocated buffers in one system call). Files per Layer Block would multiply the file
count and the per-read open/metadata cost by `num_layers` (30 for SmolLM2) for no benefit, since
no reader ever wants a single layer from storage. A Full Block is `num_layers * block_size *
kv_bytes_per_token_per_layer` (2.9 MB for SmolLM2 in fp32 at 64 tokens), well above the size
where per-file overhead matters. One file per block (rather than append-only segments) keeps
writers on different nodes independent: there is no shared index to update, a block becomes
visible to every reader the moment its rename lands, and the filesystem is the index, so
`contains` is a `stat`.

Atomicity: `put` writes a temp file in the block's directory, fsyncs it (when `is_durable`),
then `os.replace`s it onto the final name. A writer killed at any point leaves at most a
`.tmp-*` file, which readers never open; the final name only ever refers to a complete file.
Integrity: every read checks the magic, the key, the size and the CRC32C of the payload (the
SSE4.2 instruction, ~15 GB/s, so verification costs a few percent of a read); a block
that fails is counted as corrupt, removed, and reported as a miss, so the caller recomputes it
and a later `put` rewrites it. Nothing is lost: a miss only costs recompute.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import struct
import tempfile
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
    num_puts: int = 0
    num_skipped_puts: int = 0
    """`put(..., overwrite=False)` calls that found the block already stored."""
    read_bytes: int = 0
    written_bytes: int = 0

    @property
    def num_lookups(self) -> int:
        return self.num_hits + self.num_misses + self.num_corrupt


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

    def __init__(self, root: Path | str, full_block_bytes: int, *, is_durable: bool = True) -> None:
        """Open (creating if needed) the store at `root` for blocks of `full_block_bytes`.

        `is_durable=False` skips fsync: writes are still atomic against a process crash (the
        page cache survives it) but not against a power loss; meant for tests and benches.
        Raises StoreError if `root` already holds blocks of another size.
        """
        positive_int("blockstore", "full_block_bytes", full_block_bytes)
        self.root = Path(root)
        self._root_str = os.fspath(self.root)
        self.full_block_bytes = full_block_bytes
        self.is_durable = is_durable
        self.counters = StoreCounters()
        self._tmp_ids = itertools.count()
        self._open_meta()

    # -- metadata --------------------------------------------------------------------------
    def _open_meta(self) -> None:
        meta_path = self.root / "store.json"
        want: dict[str, Any] = {"format": FORMAT, "full_block_bytes": self.full_block_bytes}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"{self.root}: cannot create store root ({exc.strerror})") from None
        if not meta_path.exists():
            # A fresh file per caller: threads of one process share a pid, and rewriting a
            # shared temp name would truncate the inode already linked as store.json.
            fd, tmp_name = tempfile.mkstemp(prefix=".tmp-store.json-", dir=self.root)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(want) + "\n")
            tmp = Path(tmp_name)
            # Another process may win the race; os.link fails if it did, and we then read
            # (and check) its metadata instead of overwriting it.
            try:
                os.link(tmp, meta_path)
            except FileExistsError:
                pass
            except OSError:  # no hard links (some FUSE mounts): a rename is atomic too
                if not meta_path.exists():
                    os.replace(tmp, meta_path)
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
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
        path.parent.mkdir(exist_ok=True)
        header = _encode_header(key, mv.nbytes, crc32c.crc32c(mv))
        tmp = path.parent / f".tmp-{path.stem}-{os.getpid()}-{next(self._tmp_ids)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, [header, mv])
            if self.is_durable:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        # Invariant: the final name is bound only to complete, checksummed files.
        os.replace(tmp, path)
        if self.is_durable:
            _fsync_dir(path.parent)
        self.counters.num_puts += 1
        self.counters.written_bytes += self.file_bytes
        return True

    # -- read ------------------------------------------------------------------------------
    def get_into(self, key: bytes, out: Any) -> bool:
        """Read the block of `key` into `out` (a writable buffer of `full_block_bytes`).

        Returns True on a verified hit. Returns False on a miss or a corrupt block (counted in
        `counters`); `out` then holds unspecified bytes and must not be used.
        """
        path = self._path_str(key)
        mv = memoryview(out).cast("B")
        if mv.readonly or mv.nbytes != self.full_block_bytes:
            raise StoreError(
                f"get_into {key.hex()}: out must be a writable buffer of "
                f"{self.full_block_bytes} bytes, got {mv.nbytes} (readonly={mv.readonly})"
            )
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self.counters.num_misses += 1
            return False
        header = bytearray(HEADER_BYTES)
        try:
            got = _preadv_all(fd, [header, mv])
        finally:
            os.close(fd)
        payload_crc = None
        if got == self.file_bytes:
            payload_crc = _check_header(header, key, self.full_block_bytes)
        if payload_crc is None or crc32c.crc32c(mv) != payload_crc:
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

    def remove_stale_temp(self, max_age_s: float = 3600.0) -> int:
        """Delete `.tmp-*` files older than `max_age_s` (left by killed writers); returns how
        many. Younger ones may belong to live writers on other processes or machines."""
        now = time.time()
        removed = 0
        for tmp in self.root.glob("*/.tmp-*"):
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > max_age_s:
                    tmp.unlink()
                    removed += 1
        return removed

    def keys(self) -> list[bytes]:
        """Keys of all stored blocks (a directory walk; for tools and tests)."""
        return [bytes.fromhex(p.stem) for p in sorted(self.root.glob("*/*.blk"))]


def _write_all(fd: int, buffers: list[Any]) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _preadv_all(fd: int, buffers: list[Any]) -> int:
    """preadv until the buffers are full or the file ends; returns the bytes read."""
    views = [memoryview(b).cast("B") for b in buffers]
    total = 0
    while views:
        n = os.preadv(fd, views, total)
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
