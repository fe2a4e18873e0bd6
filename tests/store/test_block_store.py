"""BlockStore: atomic puts, checksummed reads into preallocated buffers, crash consistency."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.core.blocks import block_keys
from dualpath.core.errors import SpecError
from dualpath.store import HEADER_BYTES, BlockStore, StoreError, fileio
from dualpath.store import block_store as store_module

BLOCK_BYTES = 4096


def payload(seed: int, nbytes: int = BLOCK_BYTES) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def test_put_then_get_into_preallocated_buffer(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, BLOCK_BYTES, is_durable=False)
    keys = block_keys(list(range(64 * 3)), 64)
    for i, key in enumerate(keys):
        assert store.put(key, memoryview(payload(i)))
    out = np.zeros(BLOCK_BYTES, dtype=np.uint8)
    address = out.ctypes.data
    for i, key in enumerate(keys):
        assert store.get_into(key, memoryview(out))
        assert out.tobytes() == payload(i)
        assert out.ctypes.data == address  # read in place, not into a new buffer
    assert store.counters.num_hits == 3
    assert store.counters.read_bytes == 3 * (BLOCK_BYTES + HEADER_BYTES)
    assert sorted(store.keys()) == sorted(keys)


def test_a_scatter_read_fills_several_buffers_in_order_and_is_verified(
        tmp_path: Path) -> None:
    """`get_into` with a list of buffers: each layer's page straight into its own place."""
    store = BlockStore(tmp_path, BLOCK_BYTES, is_durable=False)
    key = block_keys(list(range(64)), 64)[0]
    store.put(key, payload(3))
    pages = [np.zeros(BLOCK_BYTES // 4, dtype=np.uint8) for _ in range(4)]
    assert store.get_into(key, [memoryview(p) for p in pages])
    assert b"".join(p.tobytes() for p in pages) == payload(3)
    raw = bytearray(store.path_of(key).read_bytes())
    raw[HEADER_BYTES + 3 * BLOCK_BYTES // 4 + 5] ^= 0x01  # in the last buffer's share
    store.path_of(key).write_bytes(raw)
    assert not store.get_into(key, [memoryview(p) for p in pages])
    assert store.counters.num_corrupt == 1
    with pytest.raises(StoreError, match="writable buffers of 4096 bytes, got 3072"):
        store.get_into(key, [memoryview(p) for p in pages[:3]])


def test_a_block_larger_than_a_read_piece_is_read_and_checked_in_pieces(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read and checksummed `READ_CHUNK_BYTES` at a time (a file of several vLLM blocks),
    into one buffer or into more buffers than one `preadv` takes (IOV_MAX): the same bytes,
    and a flipped byte in a later piece or a short file is still never served."""
    nbytes = 1200 * 8  # 1,200 pages of 8 B: more buffers than IOV_MAX (1,024)
    store = BlockStore(tmp_path, nbytes, is_durable=False)
    key = block_keys(list(range(64)), 64)[0]
    store.put(key, payload(5, nbytes))
    pages = [np.zeros(8, dtype=np.uint8) for _ in range(1200)]
    assert store.get_into(key, [memoryview(p) for p in pages])
    assert b"".join(p.tobytes() for p in pages) == payload(5, nbytes)
    monkeypatch.setattr(store_module, "READ_CHUNK_BYTES", 1000)  # pieces of one buffer
    whole = np.zeros(nbytes, dtype=np.uint8)
    assert store.get_into(key, memoryview(whole))
    assert whole.tobytes() == payload(5, nbytes)
    raw = bytearray(store.path_of(key).read_bytes())
    raw[HEADER_BYTES + nbytes - 3] ^= 0x10  # in the last piece
    store.path_of(key).write_bytes(raw)
    assert not store.get_into(key, [memoryview(p) for p in pages])
    store.put(key, payload(5, nbytes))
    store.path_of(key).write_bytes(store.path_of(key).read_bytes()[:-2000])  # short
    assert not store.get_into(key, memoryview(whole))
    assert store.counters.num_corrupt == 2 and store.counters.num_hits == 2


def test_missing_block_is_a_counted_miss(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, BLOCK_BYTES, is_durable=False)
    assert not store.get_into(b"\x01" * 16, bytearray(BLOCK_BYTES))
    assert store.counters.num_misses == 1
    assert store.counters.num_hits == 0


def test_longest_prefix_walks_chained_keys(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, BLOCK_BYTES, is_durable=False)
    keys = block_keys(list(range(64 * 5)), 64)
    for key in keys[:3]:
        store.put(key, payload(0))
    store.put(keys[4], payload(0))  # not reachable: block 3 is missing
    assert store.longest_prefix(keys) == 3
    assert store.contains(keys[4]) and not store.contains(keys[3])


def test_flipped_byte_is_detected_counted_and_removed(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, BLOCK_BYTES, is_durable=False)
    key = block_keys(list(range(64)), 64)[0]
    store.put(key, payload(7))
    path = store.path_of(key)
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 1234] ^= 0x40
    path.write_bytes(raw)
    out = bytearray(BLOCK_BYTES)
    assert not store.get_into(key, out)
    assert store.counters.num_corrupt == 1 and store.counters.num_hits == 0
    assert not store.contains(key)  # removed, so the next put rewrites it
    store.put(key, payload(7))
    assert store.get_into(key, out) and bytes(out) == payload(7)


@pytest.mark.parametrize("damage", ["truncate", "header", "swap_key"])
def test_torn_or_foreign_files_are_never_served(tmp_path: Path, damage: str) -> None:
    store = BlockStore(tmp_path, BLOCK_BYTES, is_durable=False)
    k1, k2 = block_keys(list(range(128)), 64)
    store.put(k1, payload(1))
    store.put(k2, payload(2))
    p1, p2 = store.path_of(k1), store.path_of(k2)
    if damage == "truncate":  # what a non-atomic writer would leave after a crash
        p1.write_bytes(p1.read_bytes()[: HEADER_BYTES + BLOCK_BYTES // 2])
    elif damage == "header":
        raw = bytearray(p1.read_bytes())
        raw[20] ^= 0xFF  # payload-size / crc field
        p1.write_bytes(raw)
    else:  # a valid block of another key under k1's name
        p1.write_bytes(p2.read_bytes())
    assert not store.get_into(k1, bytearray(BLOCK_BYTES))
    assert store.counters.num_corrupt == 1
    assert store.get_into(k2, bytearray(BLOCK_BYTES))


@settings(max_examples=60, deadline=None)
@given(offset=st.integers(0, HEADER_BYTES + 256 - 1), bit=st.integers(0, 7))
def test_any_flipped_bit_anywhere_in_the_file_is_never_served(
    tmp_path_factory: pytest.TempPathFactory, offset: int, bit: int
) -> None:
    store = BlockStore(tmp_path_factory.mktemp("flip"), 256, is_durable=False)
    key = b"f" * 16
    store.put(key, payload(9, 256))
    path = store.path_of(key)
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 1 << bit
    path.write_bytes(raw)
    assert not store.get_into(key, bytearray(256))
    assert store.counters.num_corrupt == 1


def test_put_without_overwrite_skips_existing(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, BLOCK_BYTES, is_durable=True)
    key = b"k" * 16
    assert store.put(key, payload(1), overwrite=False)
    assert not store.put(key, payload(2), overwrite=False)
    out = bytearray(BLOCK_BYTES)
    assert store.get_into(key, out) and bytes(out) == payload(1)
    assert store.counters.num_skipped_puts == 1
    assert not list(tmp_path.glob("*/.tmp-*"))


def test_bad_inputs_raise_one_line_errors(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, BLOCK_BYTES, is_durable=False)
    with pytest.raises(StoreError, match="4096"):
        store.put(b"k" * 16, b"short")
    with pytest.raises(StoreError, match="writable"):
        store.get_into(b"k" * 16, bytes(BLOCK_BYTES))
    with pytest.raises(StoreError, match="key"):
        store.put(b"", payload(0))
    with pytest.raises(StoreError, match=r"store\.json: full_block_bytes=4096"):
        BlockStore(tmp_path, 8192)


def test_two_instances_share_one_root(tmp_path: Path) -> None:
    writer = BlockStore(tmp_path, BLOCK_BYTES, is_durable=False)
    reader = BlockStore(tmp_path, BLOCK_BYTES, is_durable=False)
    key = b"s" * 16
    writer.put(key, payload(3))
    out = bytearray(BLOCK_BYTES)
    assert reader.get_into(key, out) and bytes(out) == payload(3)


def test_stale_temp_files_are_swept(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, BLOCK_BYTES, is_durable=False)
    store.put(b"a" * 16, payload(0))
    tmp = tmp_path / ".tmp" / ".tmp-dead-1-0"
    tmp.write_bytes(b"partial")
    assert store.remove_stale_temp(max_age_s=3600) == 0
    old = time.time() - 7200
    os.utime(tmp, (old, old))
    assert store.remove_stale_temp(max_age_s=3600) == 1
    assert store.keys() == [b"a" * 16]


def test_opening_a_store_removes_the_temps_of_dead_writers_only(tmp_path: Path) -> None:
    key = b"t" * 16
    folder = tmp_path / ".tmp"
    folder.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process now
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # Names as `put` makes them: .tmp-<key>-<host tag>-<pid>-<n>.
        tag = fileio._HOST_TAG
        temps = {pid: folder / f".tmp-{key.hex()}-{tag}-{pid}-0"
                 for pid in (dead.pid, alive.pid, os.getpid())}
        for t in temps.values():
            t.write_bytes(b"partial")
        store = BlockStore(tmp_path, BLOCK_BYTES, is_durable=False)
        assert store.counters.num_stale_temps_removed == 1
        assert not temps[dead.pid].exists()
        assert temps[alive.pid].exists() and temps[os.getpid()].exists()  # may be writing
        store.put(key, payload(0))
        # A second open of the root in this process (a worker's store and its side
        # channel's) does not repeat the sweep.
        temps[dead.pid].write_bytes(b"partial")
        reopened = BlockStore(tmp_path, BLOCK_BYTES, is_durable=False)
        assert reopened.counters.num_stale_temps_removed == 0 and temps[dead.pid].exists()
        assert reopened.remove_stale_temp() == 1
        assert reopened.get_into(key, bytearray(BLOCK_BYTES))
    finally:
        alive.kill()
        alive.wait()


def test_writes_in_progress_live_in_one_folder_the_sweep_lists(tmp_path: Path) -> None:
    # A store of an earlier version: a dead writer's temp beside its blocks, no temp folder.
    key = b"u" * 16
    folder = tmp_path / key.hex()[:2]
    folder.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = f".tmp-{key.hex()}-{fileio._HOST_TAG}-{dead.pid}"
    beside = folder / f"{name}-0"
    beside.write_bytes(b"partial")
    store = BlockStore(tmp_path, BLOCK_BYTES, is_durable=False)
    # The open that made the temp folder walked the block folders, once.
    assert store.counters.num_stale_temps_removed == 1 and not beside.exists()
    # Since then sweeps list the temp folder only, however many block folders there are.
    beside.write_bytes(b"partial")
    inside = tmp_path / ".tmp" / f"{name}-1"
    inside.write_bytes(b"partial")
    assert BlockStore(tmp_path, BLOCK_BYTES).remove_stale_temp() == 1
    assert beside.exists() and not inside.exists()
    assert store.remove_stale_temp(in_block_folders=True) == 1 and not beside.exists()
    # A temp folder removed under an open store comes back with the next put.
    (tmp_path / ".tmp").rmdir()
    assert store.put(key, payload(1))
    out = bytearray(BLOCK_BYTES)
    assert store.get_into(key, out) and bytes(out) == payload(1)
    assert store.keys() == [key] and not list((tmp_path / ".tmp").iterdir())


def test_a_store_with_a_capacity_evicts_the_least_recently_used_blocks(
        tmp_path: Path) -> None:
    one = HEADER_BYTES + BLOCK_BYTES
    store = BlockStore(tmp_path, BLOCK_BYTES, is_durable=False, capacity_bytes=4 * one)
    keys = [bytes([i]) * 16 for i in range(6)]
    for i, key in enumerate(keys[:4]):
        store.put(key, payload(i))
    assert store.counters.num_evicted == 0 and len(store.keys()) == 4  # at capacity, kept
    old = time.time() - 3600
    for i, key in enumerate(keys[:4]):  # used in key order, an hour ago
        os.utime(store.path_of(key), (old + i, old + i))
    # A write in progress (a temp file, older than every block) is never evicted.
    writing = tmp_path / ".tmp" / f".tmp-{keys[0].hex()}-x-1-0"
    writing.write_bytes(bytes(one))
    os.utime(writing, (old - 10, old - 10))
    assert store.get_into(keys[0], bytearray(BLOCK_BYTES))  # block 0 used now
    store.put(keys[4], payload(4))  # 5 blocks: down to 90% of 4, the 2 least recent go
    assert store.counters.num_evicted == 2
    assert sorted(store.keys()) == sorted([keys[0], keys[3], keys[4]])
    assert writing.exists()
    assert not store.get_into(keys[1], bytearray(BLOCK_BYTES))  # a miss: recomputed
    store.put(keys[5], payload(5))  # 4 blocks: within the capacity again
    assert store.counters.num_evicted == 2 and len(store.keys()) == 4
    with pytest.raises(SpecError, match="capacity_bytes"):
        BlockStore(tmp_path, BLOCK_BYTES, capacity_bytes=0)


def test_two_stores_of_one_process_put_one_key_from_many_threads(tmp_path: Path) -> None:
    # Nodes launched as threads each open their own store in one process: their temp names
    # once came from per-store counters, so two stores' first puts shared one name.
    import threading

    nbytes = 1 << 20  # long writes, so the puts overlap
    stores = [BlockStore(tmp_path, nbytes, is_durable=False) for _ in range(2)]
    data = payload(5, nbytes)
    key = b"r" * 16
    start = threading.Barrier(30)
    errors: list[BaseException] = []

    def put(store: BlockStore) -> None:
        start.wait()
        try:
            store.put(key, data)
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=put, args=(stores[i % 2],)) for i in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(s.counters.num_puts for s in stores) == 30
    out = bytearray(nbytes)
    assert stores[0].get_into(key, out) and bytes(out) == data
    assert not list(tmp_path.glob("*/.tmp-*"))


def test_threads_opening_a_new_store_together_all_read_its_metadata(tmp_path: Path) -> None:
    # Threads share a pid: a shared temp name once let one truncate the linked store.json
    # while another read it.
    import threading

    errors: list[BaseException] = []

    def open_store(root: Path) -> None:
        try:
            BlockStore(root, 4096)
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    for trial in range(20):
        root = tmp_path / f"s{trial}"
        threads = [threading.Thread(target=open_store, args=(root,)) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []


def _modes(root: Path) -> dict[str, set[int]]:
    """The permission bits of every file and folder under `root`, by kind."""
    modes: dict[str, set[int]] = {"file": set(), "dir": set()}
    for p in [root, *root.rglob("*")]:
        modes["dir" if p.is_dir() else "file"].add(p.stat().st_mode & 0o777)
    return modes


def test_a_new_store_is_readable_by_its_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        store = BlockStore(tmp_path / "s", BLOCK_BYTES, is_durable=False)
        store.put(b"k" * 16, payload(1))
    finally:
        os.umask(old)
    assert _modes(tmp_path / "s") == {"file": {0o600}, "dir": {0o700}}


def test_a_configured_group_mode_is_applied_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        store = BlockStore(tmp_path / "s", BLOCK_BYTES, is_durable=False, file_mode=0o640)
        store.put(b"k" * 16, payload(1))
    finally:
        os.umask(old)
    assert _modes(tmp_path / "s") == {"file": {0o640}, "dir": {0o750}}


@pytest.mark.parametrize("mode", [0o400, 0o1777, -1])
def test_a_mode_that_locks_out_the_owner_is_refused(tmp_path: Path, mode: int) -> None:
    with pytest.raises(SpecError, match="file_mode"):
        BlockStore(tmp_path, BLOCK_BYTES, file_mode=mode)
