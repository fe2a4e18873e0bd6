"""BlockStore throughput: Full Blocks read into preallocated buffers, and written atomically.

Two block sizes: SmolLM2-135M's fp32 Full Block of 64 tokens (30 layers x 64 x 1,536 B =
2.95 MB, what the runtime stores) and the tiny test model's (4 layers x 16 tokens x 256 B =
16 KiB, where per-block costs dominate). Reported per size, median over repeats after a warm-up:

- read GB/s of `get_into` (open + one preadv of header and payload + header check + CRC32C), and
  the ratio against a baseline measured in the same process on the same files: a bare
  `os.preadv` of the same bytes into the same buffers (no verification). The files were just
  written, so both read from the page cache: this is the store's software cost, the part the
  runtime adds on top of whatever the filesystem delivers;
- per-block overhead in microseconds: store time per block minus the baseline's;
- write GB/s of `put` without fsync (ratio against bare writes of the same bytes to new files)
  and with fsync (`is_durable=True`, the default; bounded by the disk, not the store);
- the headroom against the emulated storage NIC of the `cpu-emulated` preset (200 MiB/s): the
  store must not be what limits a node's storage reads.

Run: `.venv/bin/python benchmarks/runtime/bench_store.py` (about 20 s; `--repeats`, `--mib` to
change).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dualpath.core.hardware import hardware_preset
from dualpath.runtime.kvlayout import KVLayout
from dualpath.store import BlockStore

GB = 10**9

LAYOUTS = {
    "smollm2-fp32-64tok": KVLayout(num_layers=30, block_size=64, num_kv_heads=3, head_dim=64),
    "tiny-fp32-16tok": KVLayout(num_layers=4, block_size=16, num_kv_heads=2, head_dim=16),
}


def median_time(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up (page cache, allocator, first-touch of the buffers)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_layout(name: str, layout: KVLayout, root: Path, total_bytes: int, repeats: int,
                 nic_bytes_per_s: float) -> None:
    nbytes = layout.full_block_bytes
    num_blocks = max(8, total_bytes // nbytes)
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(min(num_blocks, 8))]
    keys = [i.to_bytes(16, "little") for i in range(num_blocks)]
    store = BlockStore(root / name, nbytes, is_durable=False)
    for i, key in enumerate(keys):
        store.put(key, memoryview(blocks[i % len(blocks)]))
    outs = [np.empty(nbytes, dtype=np.uint8) for _ in range(num_blocks)]
    views = [memoryview(o) for o in outs]
    paths = [store.path_of(k) for k in keys]

    def read_store() -> None:
        for key, out in zip(keys, views, strict=True):
            if not store.get_into(key, out):
                raise RuntimeError(f"block {key.hex()} missing or corrupt")

    header = bytearray(store.file_bytes - nbytes)

    def read_raw() -> None:
        for path, out in zip(paths, views, strict=True):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.preadv(fd, [header, out], 0)
            finally:
                os.close(fd)

    t_store = median_time(read_store, repeats)
    t_raw = median_time(read_raw, repeats)
    moved = num_blocks * nbytes
    read_gbps, raw_gbps = moved / t_store / GB, moved / t_raw / GB
    overhead_us = (t_store - t_raw) / num_blocks * 1e6

    write_counter = iter(range(10**9))

    def write(durable: bool, count: int) -> Callable[[], None]:
        wstore = BlockStore(root / f"{name}-w{int(durable)}", nbytes, is_durable=durable)

        def run() -> None:
            base = next(write_counter) * count
            for i in range(count):
                wstore.put((base + i).to_bytes(16, "little"), memoryview(blocks[i % len(blocks)]))

        return run

    raw_dir = root / f"{name}-raw"
    raw_dir.mkdir()

    def write_raw() -> None:
        # Baseline: the same bytes to new files, no header, checksum, temp name or rename.
        base = next(write_counter) * num_blocks
        for i in range(num_blocks):
            fd = os.open(raw_dir / str(base + i), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.writev(fd, [header, blocks[i % len(blocks)]])
            finally:
                os.close(fd)

    num_durable = max(4, min(num_blocks, 64, (32 << 20) // nbytes))
    t_write_raw = median_time(write_raw, repeats)
    t_write = median_time(write(False, num_blocks), repeats)
    t_write_durable = median_time(write(True, num_durable), max(1, repeats // 2))
    write_gbps, write_raw_gbps = moved / t_write / GB, moved / t_write_raw / GB
    durable_gbps = num_durable * nbytes / t_write_durable / GB

    print(f"== {name}: Full Block {nbytes:,} B, {num_blocks} blocks ({moved / 2**20:.0f} MiB)")
    print(f"  read  get_into     {read_gbps:7.2f} GB/s  {t_store / num_blocks * 1e6:9.1f} us/block")
    print(f"  read  bare preadv  {raw_gbps:7.2f} GB/s  {t_raw / num_blocks * 1e6:9.1f} us/block"
          f"  (baseline)")
    print(f"  read  ratio store/baseline {read_gbps / raw_gbps:5.2f}; per-block overhead "
          f"{overhead_us:.1f} us (open + header + CRC32C beyond the bare read)")
    per_write_us = t_write / num_blocks * 1e6
    print(f"  write put (no fsync) {write_gbps:7.2f} GB/s  {per_write_us:9.1f} us/block"
          f"  (bare write baseline {write_raw_gbps:.2f} GB/s, ratio "
          f"{write_gbps / write_raw_gbps:.2f})")
    print(f"  write put (fsync)    {durable_gbps:7.2f} GB/s  "
          f"{t_write_durable / num_durable * 1e6:9.1f} us/block")
    print(f"  read headroom vs emulated storage NIC ({nic_bytes_per_s / 2**20:.0f} MiB/s): "
          f"{read_gbps * GB / nic_bytes_per_s:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mib", type=int, default=96, help="bytes read per repeat, in MiB")
    args = parser.parse_args()
    nic = hardware_preset("cpu-emulated").storage_nic_bytes_per_s
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        for name, layout in LAYOUTS.items():
            total = args.mib << 20 if layout.full_block_bytes > 1 << 20 else 8 << 20
            bench_layout(name, layout, Path(tmp), total, args.repeats, nic)


if __name__ == "__main__":
    main()
