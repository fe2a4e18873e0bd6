"""`BlockStore`: Full Blocks on a filesystem path, keyed by prefix-chained block keys (the
package docstring, `dualpath.store`, describes the layout and its promises)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c

from dualpath.core.blocks import longest_prefix as _longest_prefix
from dualpath.core.errors import DualPathError, SpecError
from dualpath.core.validate import positive_int
from dualpath.store.fileio import (
    create_temp,
    first_open_here,
    fsync_dir,
    is_dead_local_writer,
    pieces,
    preadv_all,
    touch,
    write_all,
)
from dualpath.store.format import FORMAT, HEADER_BYTES, MAX_KEY_BYTES, check_header, encode_header

STALE_TEMP_AGE_S = 3600.0
"""A temp file older than this is stale whoever wrote it (no put takes an hour)."""
TEMP_DIR = ".tmp"
"""The folder under a store root where every write in progress lives."""
EVICT_TO = 0.9
"""A store over its capacity evicts down to this fraction of it (so a scan is rare)."""
CRC_RELEASE_GIL_BYTES = int(os.environ.get("DUALPATH_CRC_RELEASE_GIL_BYTES", 256 * 1024))
"""A buffer at least this large is checksummed with the GIL released (other threads run
meanwhile); a smaller one holds it (`DUALPATH_CRC_RELEASE_GIL_BYTES` overrides it): with many
reader threads, releasing it for every small page costs more CPU than the checksum itself,
since each call then waits for the GIL back (docs/measurements.md, "Block store")."""
READ_CHUNK_BYTES = 4 << 20
"""`get_into` reads a block this many payload bytes at a time and checksums each piece
right after its read, while it is still in the CPU's caches (one `preadv` per piece); a large
file read whole and then checksummed costs more CPU per byte. Blocks up to this size are one
`preadv`."""
DEFAULT_FILE_MODE = 0o600
"""Block files hold prompt content: owner-only unless the store is configured otherwise."""


def store_file_mode(value: object) -> int:
    """A configured file mode: an octal string ("0640", "640", "0o640") or an int; None is
    the default (owner only). Checked when the store opens."""
    if value is None:
        return DEFAULT_FILE_MODE
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip().lower().removeprefix("0o")
    try:
        return int(text, 8)
    except ValueError:
        raise SpecError("blockstore", "store_file_mode", value,
                        "must be octal permission bits, e.g. \"0640\"") from None


def dir_mode_of(file_mode: int) -> int:
    """The folder mode for files of `file_mode`: each class that may read may also search."""
    return file_mode | ((file_mode & 0o444) >> 2)


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



class BlockStore:
    """Full Blocks of one fixed size on a filesystem path.

    Safe to use from many processes (and machines sharing the mount) at once; one instance is
    not thread-safe (its counters are plain integers).
    """

    def __init__(self, root: Path | str, full_block_bytes: int, *, is_durable: bool = True,
                 capacity_bytes: int | None = None, file_mode: int = DEFAULT_FILE_MODE
                 ) -> None:
        """Open (creating if needed) the store at `root` for blocks of `full_block_bytes`.

        `is_durable=False` skips fsync: writes are still atomic against a process crash (the
        page cache survives it) but not against a power loss; meant for tests and benches.
        `capacity_bytes`: evict least recently used blocks beyond about that many bytes of
        block files (None: keep every block). `file_mode`: the permission bits of every file
        this store creates (folders get the matching search bits); owner-only by default,
        since blocks hold prompt content. Raises StoreError if `root` already holds blocks of
        another size.
        """
        positive_int("blockstore", "full_block_bytes", full_block_bytes)
        if not isinstance(file_mode, int) or isinstance(file_mode, bool) or \
                not 0 <= file_mode <= 0o777 or not file_mode & 0o600 == 0o600:
            raise SpecError("blockstore", "file_mode", oct(file_mode) if isinstance(
                file_mode, int) else file_mode, "must be permission bits (0o600..0o777) that "
                "let the owner read and write")
        self.file_mode = file_mode
        self.dir_mode = dir_mode_of(file_mode)
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
            is_new_temp_dir = self._mkdir(self._temp_dir)
        except OSError:  # there already (or a read-only store: puts fail and are counted)
            is_new_temp_dir = False
        if first_open_here(self._root_str) or is_new_temp_dir:
            self.counters.num_stale_temps_removed = self.remove_stale_temp(
                in_block_folders=is_new_temp_dir)

    # -- metadata --------------------------------------------------------------------------
    def _open_meta(self) -> None:
        meta_path = self.root / "store.json"
        want: dict[str, Any] = {"format": FORMAT, "full_block_bytes": self.full_block_bytes}
        try:
            if not self.root.is_dir():
                self.root.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(OSError):  # another user's folder: theirs to set
                    os.chmod(self.root, self.dir_mode)
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
            os.fchmod(fd, self.file_mode)
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

    def _mkdir(self, path: str) -> bool:
        """Create folder `path` with the store's mode (whatever the umask); an existing one is
        left as it is. Returns whether it was created."""
        try:
            os.mkdir(path, self.dir_mode)
        except FileExistsError:
            return False
        os.chmod(path, self.dir_mode)
        return True

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
        header = encode_header(key, mv.nbytes, crc32c.crc32c(mv))
        tmp = ""
        try:
            if not os.path.isdir(path.parent):
                self._mkdir(os.fspath(path.parent))
            fd, tmp = create_temp(self._temp_dir, path.stem, self.file_mode)
            try:
                write_all(fd, [header, mv])
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
            fsync_dir(path.parent)
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
            for n, piece in enumerate(pieces(views, READ_CHUNK_BYTES)):
                want = sum(v.nbytes for v in piece)
                got_now = preadv_all(fd, [header, *piece] if n == 0 else piece, got)
                got += got_now
                if got_now < want + (HEADER_BYTES if n == 0 else 0):
                    break  # a short file: not a block
                for v in piece:  # while it is in the caches
                    crc = crc32c.crc32c(v, crc, gil_release_mode=int(
                        v.nbytes >= CRC_RELEASE_GIL_BYTES))
            if self.capacity_bytes is not None:
                touch(fd)
        except OSError:  # a directory (EISDIR), a FIFO (ESPIPE), an I/O error
            self.counters.num_unreadable += 1
            return False
        finally:
            os.close(fd)
        payload_crc = None
        if got == self.file_bytes:
            payload_crc = check_header(header, key, self.full_block_bytes)
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
                if is_dead_local_writer(tmp.name) or now - tmp.stat().st_mtime > max_age_s:
                    tmp.unlink()
                    removed += 1
        return removed

    def keys(self) -> list[bytes]:
        """Keys of all stored blocks (a directory walk; for tools and tests)."""
        return [bytes.fromhex(p.stem) for p in sorted(self.root.glob("*/*.blk"))]
