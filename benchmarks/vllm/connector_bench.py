"""The vLLM connector's data path against this machine's plain rates, and the router's cost.

Loads `--gb` of stored blocks (page-cache warm, unpaced) into vLLM-shaped paged KV (one raw
buffer, per-layer `[B, H, N, C]` views in LBHNC, what the connector asks vLLM for) of a
70B-shaped model (64 layers, 8 KV heads / `--tp`, head dim 128, bf16), with 16- and 128-token
blocks, through:

- **PE**: the prefill node's own store reads (`kvio.KVWorker.load`: one verified `preadv` per
  Full Block) and their per-layer copies into the paged KV (`inject`, once per layer);
- **DE**: the DE read path's staging pull: the decode side's staging service reads the blocks
  into its slots (`stage` over the side channel), and the prefill side pulls them per layer over
  NIXL (UCX, in one process here) into its paged KV (`PrefillRemote.load` / `inject`), NIXL
  straight into the pages (`direct`) or into a pinned host bounce buffer and copied from there
  (`bounce`, the default for a GPU's KV: `--de-pull`);

beside two baselines measured in the same run on the same bytes: a plain `read` (`os.preadv`
of each block's file into one buffer, no checksum) and a plain `memcpy` (one copy of the same
number of bytes between two preallocated buffers). Each rate is the median of `--repeats`
after a warm-up, in wall time and in this process's CPU time (every thread's, the staging
service's and NIXL's included): bytes per CPU-second is what a path costs whatever else runs
on the machine, while its wall-time rate also depends on the cores left free (a path with
parallel reads gains from idle cores, one plain `read` cannot). Then the router's
scheduling cost (`RoutePolicy.schedule`) with `--instances` (half prefill, half decode) and
`--waiting` requests queued, and the cost of counting a 32K-token prompt's stored prefix
(`StoreManifest.hit_blocks`, a `stat` per block, one by one and in waves on the router's
threads; here and with an NFS-like round trip per `stat`), and the parse of one instance's
`/metrics` page.

`--blocks-per-file` stores g vLLM blocks a file (the connector's `blocks_per_file`): the
same bytes in 1/g of the files; a row per g, and the stored-prefix count per g. `--paths
save` adds the save path (`KVWorker.capture` and `flush` into a durable store: a temp file,
an fsync and a rename per file).

Run: `.venv/bin/python benchmarks/vllm/connector_bench.py` (about a minute at 1 GB; `--gb`,
`--repeats`, `--block-tokens`, `--blocks-per-file`, `--tp`, `--paths`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import itertools
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import torch

from dualpath.core.blocks import block_keys, max_hit_blocks
from dualpath.integrations.vllm.connector.kvio import KVWorker
from dualpath.integrations.vllm.connector.remote import STAGE_PIECES
from dualpath.integrations.vllm.connector.step_plan import BlockTransfer, RemoteLoad, StepPlan
from dualpath.integrations.vllm.manifest import StoreManifest
from dualpath.integrations.vllm.router.policy import RoutePolicy, route_params
from dualpath.integrations.vllm.router.router import STAT_THREADS
from dualpath.integrations.vllm.router.scrape import parse_vllm_metrics
from dualpath.store import CRC_RELEASE_GIL_BYTES, HEADER_BYTES, BlockStore

GB = 10**9
NFS_STAT_S = 0.0002
"""The metadata round trip the router's stored-prefix count is also timed with."""
LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 64, 8, 128, 2


@dataclass(frozen=True)
class Shape:
    """One rank's KV of a 70B-shaped model, `block_tokens` per block."""

    block_tokens: int
    heads: int

    @property
    def page_bytes(self) -> int:
        return self.heads * self.block_tokens * 2 * HEAD_DIM * DTYPE_BYTES

    @property
    def full_block_bytes(self) -> int:
        return LAYERS * self.page_bytes


def median_s(fn: Callable[[], None], repeats: int) -> float:
    return measure(fn, repeats)[0]


def cpu_s() -> float:
    """CPU seconds of this process so far, every thread's, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(fn: Callable[[], None], repeats: int) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds of `fn` over `repeats` after a warm-up."""
    fn()  # warm-up: page cache, first touch, NIXL connections
    walls, cpus = [], []
    for _ in range(repeats):
        c0, t0 = cpu_s(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(cpu_s() - c0)
    return statistics.median(walls), statistics.median(cpus)


def paged_kv(shape: Shape, num_blocks: int, device: str) -> dict[str, torch.Tensor]:
    """vLLM's per-layer views of one raw buffer, LBHNC: layer-major, a page per block."""
    raw = torch.zeros(LAYERS * num_blocks * shape.page_bytes // DTYPE_BYTES,
                      dtype=torch.bfloat16, device=device)
    per_layer = raw.view(LAYERS, num_blocks, shape.heads, shape.block_tokens, 2 * HEAD_DIM)
    return {f"model.layers.{i}.self_attn.attn": per_layer[i] for i in range(LAYERS)}


def fill_store(store: BlockStore, num_blocks: int, block_tokens: int,
               blocks_per_file: int = 1) -> list[bytes]:
    """`num_blocks` blocks in files of `blocks_per_file` (each under its last block's key);
    returns the files' keys."""
    g = blocks_per_file
    keys = block_keys(list(range(num_blocks * block_tokens)), block_tokens)[g - 1::g]
    gen = torch.Generator().manual_seed(0)
    block = torch.randint(0, 256, (store.full_block_bytes,), dtype=torch.uint8, generator=gen)
    for i, key in enumerate(keys):
        block[:8] = torch.tensor(list(i.to_bytes(8, "little")), dtype=torch.uint8)
        store.put(key, block.numpy().data, overwrite=False)
    return keys


def plain_read(store: BlockStore, keys: list[bytes]) -> Callable[[], None]:
    buf = bytearray(store.file_bytes)

    def run() -> None:
        for key in keys:
            fd = os.open(store.path_of(key), os.O_RDONLY)
            try:
                os.preadv(fd, [buf], 0)
            finally:
                os.close(fd)
    return run


def page_rows(kv: dict[str, torch.Tensor]) -> list[Any]:
    """Per layer, its pages as a numpy uint8 [blocks, page bytes] (as `KVWorker` keeps them:
    a page is then a cheap index, not a tensor view made per block)."""
    return [layer.view(torch.uint8).reshape(layer.shape[0], -1).numpy()
            for layer in kv.values()]


def read_in_place(store: BlockStore, kv: dict[str, torch.Tensor], keys: list[bytes],
                  block_ids: list[int], threads: ThreadPoolExecutor) -> Callable[[], None]:
    """What the PE path does on host memory, less the checks: each file's pages (its blocks',
    block-major) scattered into their places in the paged KV by one `preadv` (header
    skipped), on `threads`."""
    rows = page_rows(kv)
    g = len(block_ids) // len(keys)  # blocks a file

    def one(f: int) -> None:
        fd = os.open(store.path_of(keys[f]), os.O_RDONLY)
        try:
            os.preadv(fd, [layer[b] for b in block_ids[f * g:(f + 1) * g] for layer in rows],
                      HEADER_BYTES)
        finally:
            os.close(fd)

    def run() -> None:
        list(threads.map(one, range(len(keys))))
    return run


def crc_pages(kv: dict[str, torch.Tensor], block_ids: list[int],
              threads: ThreadPoolExecutor) -> Callable[[], None]:
    """The PE path's other half: the CRC32C of every loaded page, on `threads` (the GIL
    released as the store releases it)."""
    rows = page_rows(kv)
    mode = int(rows[0].shape[1] >= CRC_RELEASE_GIL_BYTES)

    def one(block_id: int) -> None:
        value = 0
        for layer in rows:
            value = crc32c.crc32c(layer[block_id], value, gil_release_mode=mode)

    def run() -> None:
        list(threads.map(one, block_ids))
    return run


def plain_read_spread(store: BlockStore, keys: list[bytes]) -> Callable[[], None]:
    """The plain read with a destination as large as a loader's: each file into a place of
    its own in one buffer of all the blocks (one thread, no checksum). The plain read's one
    reused buffer stays in the CPU's caches; a loader's paged KV never does."""
    dst = torch.ones(len(keys) * store.file_bytes, dtype=torch.uint8).numpy()

    def run() -> None:
        for i, key in enumerate(keys):
            fd = os.open(store.path_of(key), os.O_RDONLY)
            try:
                os.preadv(fd, [dst[i * store.file_bytes:(i + 1) * store.file_bytes]], 0)
            finally:
                os.close(fd)
    return run


def plain_memcpy(num_bytes: int) -> Callable[[], None]:
    """libc's memmove of the same bytes between two touched buffers (one thread)."""
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)

    def run() -> None:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), num_bytes)
    return run


def check_pages(kv: dict[str, torch.Tensor], store: BlockStore, keys: list[bytes],
                shape: Shape, block_ids: list[int]) -> None:
    """The first and last block's first and last pages hold the stored bytes (`keys`: the
    files', of `store.full_block_bytes // shape.full_block_bytes` blocks each)."""
    names = list(kv)
    g = store.full_block_bytes // shape.full_block_bytes
    buf = torch.empty(store.full_block_bytes, dtype=torch.uint8)
    for b in {0, len(block_ids) - 1}:
        assert store.get_into(keys[b // g], buf.numpy())
        for layer in {0, LAYERS - 1}:
            lo = (b % g) * shape.full_block_bytes + layer * shape.page_bytes
            got = kv[names[layer]][block_ids[b]].cpu().contiguous().view(torch.uint8).flatten()
            if not torch.equal(got, buf[lo:lo + shape.page_bytes]):
                raise SystemExit(f"connector_bench: block {b} layer {layer}: wrong bytes")


def sync(kv: dict[str, torch.Tensor]) -> None:
    """Wait for the GPU's queued copies (a timed run ends when the bytes are in place)."""
    first = next(iter(kv.values()))
    if first.is_cuda:
        torch.cuda.synchronize(first.device)


def pe_load(worker: KVWorker, kv: dict[str, torch.Tensor], keys: list[bytes],
            block_ids: list[int]) -> Callable[[], None]:
    plan = StepPlan(loads=[BlockTransfer("r", 0, tuple(block_ids), tuple(keys),
                                         worker.blocks_per_file)])

    def run() -> None:
        worker.bind(plan)
        worker.load()
        for name, layer in kv.items():
            worker.inject(name, layer)
        worker.flush()
        sync(kv)
        if worker.take_load_errors():
            raise SystemExit("connector_bench: PE load errors")
    return run


def save(store: BlockStore, kv: dict[str, torch.Tensor], block_ids: list[int],
         block_tokens: int, blocks_per_file: int) -> Callable[[], None]:
    """The save path (`KVWorker.capture` per layer, then `flush`: its writer threads' puts,
    each a temp file, its fsync when `store` is durable, and a rename) of `block_ids`, in
    files of `blocks_per_file`, under new keys each run (a stored file is not written again)."""
    g = blocks_per_file
    worker = KVWorker(store, list(kv), next(iter(kv.values()))[0].numel() * DTYPE_BYTES,
                      blocks_per_file=g)
    runs = itertools.count()

    def run() -> None:
        parent = hashlib.blake2b(f"save-{next(runs)}".encode(), digest_size=16).digest()
        keys = block_keys(list(range(len(block_ids) * block_tokens)), block_tokens,
                          parent)[g - 1::g]
        worker.bind(StepPlan(saves=[BlockTransfer("s", 0, tuple(block_ids), tuple(keys), g)]))
        worker.load()
        for name, layer in kv.items():
            worker.capture(name, layer)
        worker.flush()
        if worker.counters.failed_saves:
            raise SystemExit("connector_bench: failed saves")
    return run


@contextlib.contextmanager
def de_pull(store: BlockStore, worker: KVWorker, kv: dict[str, torch.Tensor],
            keys: list[bytes], block_ids: list[int], stage_threads: int = 16,
            host_bounce: bool = False, stage_pieces: int = 0, stage_gbps: float = 0.0
            ) -> Iterator[Callable[[], None]]:
    """The DE read path in one process: a staging service (side channel, slots, NIXL target;
    `stage_threads` store reads at a time) and the prefill side's `PrefillRemote` over
    `kv` (`host_bounce`: through its pinned host buffers); one step's layerwise pull, or
    (`stage_pieces` > 0) a background load's in that many pipelined pieces
    (`PrefillRemote.pull_whole`). `stage_gbps` > 0: the decode node's store reads are paced
    at that rate (an emulated storage NIC, Gb/s)."""
    from dualpath.integrations.vllm.connector.remote import PrefillRemote
    from dualpath.integrations.vllm.connector.side_channel.staging import StagingPool
    from dualpath.integrations.vllm.connector.side_channel.tcp_server import DecodeSideChannel
    from dualpath.transport.nixl import NixlAgent, agent_name
    from dualpath.transport.pacing import Pacer
    from dualpath.transport.slots import SlotPool

    pool = StagingPool(SlotPool(None, worker.full_block_bytes, len(block_ids)))  # per block
    target = NixlAgent(agent_name("bench-decode"), progress_thread=True)
    target.register([(pool.base, pool.num_slots * worker.full_block_bytes)])
    pacer = Pacer.from_gbps(stage_gbps, "bench-decode-snic") if stage_gbps > 0 else None
    channel = DecodeSideChannel("127.0.0.1:0", pool, store, target.metadata(), target.connect,
                                pacer=pacer, read_threads=stage_threads)
    prefill = PrefillRemote(worker, kv, host_bounce=host_bounce,
                            stage_pieces=max(1, stage_pieces))

    def load() -> RemoteLoad:
        return RemoteLoad(uuid.uuid4().hex, channel.address, BlockTransfer(
            "r", 0, tuple(block_ids), tuple(keys), worker.blocks_per_file))

    def step() -> None:
        r = load()
        xfer = r.xfer
        plan = StepPlan(remote_loads=[r])
        worker.bind(plan)
        prefill.bind(plan)
        prefill.request_stages()
        worker.load()
        prefill.load()
        for name in kv:
            prefill.inject(name)
        prefill.flush()
        worker.flush()
        sync(kv)
        pool.release(xfer)
        if worker.take_load_errors():
            raise SystemExit("connector_bench: DE load errors")

    def background() -> None:  # `async_loads`: staged and pulled in pipelined pieces
        r = load()
        if prefill.pull_whole(r) != len(block_ids):
            raise SystemExit("connector_bench: DE background pull errors")
        sync(kv)
        pool.release(worker.shard.xfer(r.xfer))

    try:
        yield background if stage_pieces else step
    finally:
        prefill.close()
        channel.close()
        target.close()
        pool.close()


def pull_post_cost(root: Path, num_blocks: int, repeats: int) -> float:
    """Seconds `PrefillRemote.load` + `inject` take to post and wait the NIXL READs of
    `num_blocks` staged blocks x 64 layers of 512 B pages (so the descriptors' cost, not the
    bytes', dominates), the stage itself done before the clock starts; median of `repeats`."""
    from dualpath.integrations.vllm.connector.remote import PrefillRemote
    from dualpath.integrations.vllm.connector.side_channel.staging import StagingPool
    from dualpath.integrations.vllm.connector.side_channel.tcp_server import DecodeSideChannel
    from dualpath.transport.nixl import NixlAgent, agent_name
    from dualpath.transport.slots import SlotPool

    shape = Shape(1, 1)
    store = BlockStore(root / "store-pull", shape.full_block_bytes, is_durable=False)
    keys = fill_store(store, num_blocks, shape.block_tokens)
    kv = paged_kv(shape, num_blocks + 1, "cpu")
    block_ids = list(range(num_blocks, 0, -1))
    worker = KVWorker(store, list(kv), shape.page_bytes)
    worker.register(kv)
    pool = StagingPool(SlotPool(None, store.full_block_bytes, num_blocks))
    target = NixlAgent(agent_name("bench-decode"), progress_thread=True)
    target.register([(pool.base, pool.num_slots * store.full_block_bytes)])
    channel = DecodeSideChannel("127.0.0.1:0", pool, store, target.metadata(), target.connect)
    prefill = PrefillRemote(worker, kv)
    times = []
    try:
        for _ in range(repeats + 1):
            xfer = uuid.uuid4().hex
            plan = StepPlan(remote_loads=[RemoteLoad(xfer, channel.address, BlockTransfer(
                "r", 0, tuple(block_ids), tuple(keys)))])
            worker.bind(plan)
            prefill.bind(plan)
            prefill.request_stages()
            while None in pool.lookup(worker.shard.xfer(xfer), range(num_blocks)):
                time.sleep(0.001)
            t0 = time.perf_counter()
            prefill.load()
            for name in kv:
                prefill.inject(name)
            times.append(time.perf_counter() - t0)
            prefill.flush()
            pool.release(worker.shard.xfer(xfer))
            if worker.take_load_errors():
                raise SystemExit("connector_bench: pull load errors")
        check_pages(kv, store, keys, shape, block_ids)
    finally:
        prefill.close()
        channel.close()
        target.close()
        pool.close()
    return statistics.median(times[1:])


def bench_shape(shape: Shape, total_bytes: int, repeats: int, paths: list[str],
                root: Path, read_threads: int, device: str,
                stage_threads: list[int], de_pulls: list[str],
                blocks_per_file: int = 1, stage_gbps: float = 0.0
                ) -> list[dict[str, float | str]]:
    g = blocks_per_file
    num_blocks = max(2, total_bytes // shape.full_block_bytes) // g * g or g
    nbytes = num_blocks * shape.full_block_bytes
    store = BlockStore(root / f"store-{shape.block_tokens}-g{g}", g * shape.full_block_bytes,
                       is_durable=False)
    t0 = time.perf_counter()
    keys = fill_store(store, num_blocks, shape.block_tokens, g)
    fill_s = time.perf_counter() - t0
    kv = paged_kv(shape, num_blocks + 1, device)
    block_ids = list(range(num_blocks, 0, -1))  # not the order they are stored in
    worker = KVWorker(store, list(kv), shape.page_bytes, read_threads=read_threads,
                      blocks_per_file=g)
    worker.register(kv)  # as the connector does (`register_kv_caches`)
    rows: list[dict[str, float | str]] = []
    print(f"   {g} blocks a file: {store.counters.num_puts} files written in {fill_s:.1f} s "
          "(puts, no fsync)", file=sys.stderr, flush=True)

    def row(path: str, seconds: tuple[float, float]) -> None:
        wall, cpu = seconds
        rows.append({"block_tokens": shape.block_tokens, "blocks_per_file": g,
                     "files": len(keys), "path": path,
                     "gb": nbytes / GB, "s": wall, "gb_per_s": nbytes / wall / GB,
                     "cpu_s": cpu, "gb_per_cpu_s": nbytes / max(cpu, 1e-9) / GB})

    row("plain read", measure(plain_read(store, keys), repeats))
    row("plain read, each block its own place", measure(plain_read_spread(store, keys),
                                                        repeats))
    row("plain memcpy", measure(plain_memcpy(nbytes), repeats))
    if "pe" in paths:
        row("PE load (KVWorker)", measure(pe_load(worker, kv, keys, block_ids), repeats))
        check_pages(kv, store, keys, shape, block_ids)
        if device == "cpu":  # where the PE path's time goes: the reads, the checks
            with ThreadPoolExecutor(read_threads) as pool:
                row("  its reads alone (no CRC)",
                    measure(read_in_place(store, kv, keys, block_ids, pool), repeats))
                row("  its CRC32C alone", measure(crc_pages(kv, block_ids, pool), repeats))
    if "save" in paths:
        durable = BlockStore(root / f"save-{shape.block_tokens}-g{g}", store.full_block_bytes)
        row("save (KVWorker, fsync per file)",
            measure(save(durable, kv, block_ids, shape.block_tokens, g), repeats))
        shutil.rmtree(durable.root)
    for threads in stage_threads if "de" in paths else []:
        for how in de_pulls:
            for pieces in (0, 1, STAGE_PIECES):  # a step's pull; a background one's, whole
                for layer in kv.values():            # then pipelined
                    layer.zero_()
                with de_pull(store, worker, kv, keys, block_ids, threads,
                             host_bounce=how == "bounce", stage_pieces=pieces,
                             stage_gbps=stage_gbps) as run:
                    via = " via host" if how == "bounce" else ""
                    kind = "staging pull" if not pieces else \
                        f"background pull, staged in {pieces} piece{'s' if pieces > 1 else ''}"
                    paced = f", stage paced at {stage_gbps:g} Gb/s" if stage_gbps > 0 else ""
                    row(f"DE {kind}{via} ({threads} stage reads{paced})", measure(run, repeats))
                check_pages(kv, store, keys, shape, block_ids)
    return rows


def vllm_metrics_page(num_engines: int = 2, num_histograms: int = 25,
                      num_buckets: int = 30) -> str:
    """A `/metrics` page shaped like a vLLM instance's: per engine, the gauges the router
    reads and `num_histograms` histograms of `num_buckets` buckets it does not."""
    lines = []
    for h in range(num_histograms):
        name = f"vllm:histogram_{h}_seconds"
        lines += [f"# HELP {name} A latency.", f"# TYPE {name} histogram"]
        for e in range(num_engines):
            labels = f'engine="{e}",model_name="m"'
            lines += [f'{name}_bucket{{{labels},le="{b * 0.01:g}"}} {b * 7}.0'
                      for b in range(num_buckets)]
            lines += [f'{name}_bucket{{{labels},le="+Inf"}} 999.0',
                      f"{name}_count{{{labels}}} 999.0", f"{name}_sum{{{labels}}} 12.5"]
    for name, value in (("vllm:num_requests_running", "3.0"),
                        ("vllm:num_requests_waiting", "1.0"),
                        ("vllm:kv_cache_usage_perc", "0.25")):
        lines += [f"# TYPE {name} gauge"]
        lines += [f'{name}{{engine="{e}",model_name="m"}} {value}' for e in range(num_engines)]
    lines += ["# TYPE vllm:cache_config_info gauge"]
    lines += [f'vllm:cache_config_info{{block_size="16",engine="{e}",num_gpu_blocks="1000"}} 1.0'
              for e in range(num_engines)]
    return "\n".join(lines) + "\n"


def router_cost(num_instances: int, num_waiting: int, root: Path) -> dict[str, float]:
    """`RoutePolicy.schedule` with `num_waiting` queued 32K-token requests (2,000-block hits
    of 16 tokens) over `num_instances`, and a 32K prompt's stored-prefix count."""
    num_prefill = num_instances // 2
    params, is_rr = route_params("dualpath", 16, Shape(16, KV_HEADS).full_block_bytes / 16)
    policy = RoutePolicy(params, num_prefill, num_instances - num_prefill, is_rr)
    for i in range(num_waiting):
        policy.submit(i, 32_768, 2_000, 256)
    t0 = time.perf_counter()
    placed = policy.schedule()
    first_s = time.perf_counter() - t0
    events = []
    for route in placed[:200]:
        policy.prefill_done(route.request_id)
        t0 = time.perf_counter()
        policy.schedule()
        events.append(time.perf_counter() - t0)
    count = prefix_count_cost(root, 1)
    page = vllm_metrics_page()
    parse_s = median_s(lambda: None if parse_vllm_metrics(page, 16.0).running == 6
                       else sys.exit("connector_bench: wrong metrics"), 20)
    return {"instances": num_instances, "waiting": num_waiting, "placed": len(placed),
            "metrics_page_kib": len(page) / 1024, "metrics_parse_ms": parse_s * 1e3,
            "first_schedule_ms": first_s * 1e3,
            "event_schedule_ms": statistics.median(events) * 1e3 if events else 0.0,
            **{f"hit_blocks_32k{k}": v for k, v in count.items()}}


def prefix_count_cost(root: Path, blocks_per_file: int) -> dict[str, float]:
    """A 32K-token prompt's stored-prefix count (`StoreManifest.hit_blocks`: a `stat` per
    file of `blocks_per_file` 16-token blocks), ms: one by one and in waves on the router's
    threads, on the local disk and with `NFS_STAT_S` per `stat`."""
    g = blocks_per_file
    store = BlockStore(root / f"router-store-g{g}", 16 * g, is_durable=False)
    manifest = StoreManifest(namespace=bytes(16).hex(), model="m", block_size=16,
                             full_block_bytes=16, blocks_per_file=g)
    tokens = list(range(32_768))
    for key in block_keys(tokens, 16, manifest.namespace_bytes)[g - 1::g]:
        store.put(key, bytes(16 * g), overwrite=False)
    want = max_hit_blocks(len(tokens), 16 * g) * g  # 2,047 blocks of 16; 2,040 in files of 8

    def hit(is_stored: Callable[[bytes], bool], threads: ThreadPoolExecutor | None) -> None:
        if manifest.hit_blocks(tokens, is_stored, threads) != want:
            sys.exit("connector_bench: wrong hit")

    def remote_stat(key: bytes) -> bool:  # a metadata round trip of NFS_STAT_S first
        time.sleep(NFS_STAT_S)
        return store.contains(key)
    with ThreadPoolExecutor(STAT_THREADS) as threads:
        return {"_ms": median_s(lambda: hit(store.contains, None), 5) * 1e3,
                "_waves_ms": median_s(lambda: hit(store.contains, threads), 5) * 1e3,
                "_nfs_ms": median_s(lambda: hit(remote_stat, None), 3) * 1e3,
                "_nfs_waves_ms": median_s(lambda: hit(remote_stat, threads), 3) * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0, help="stored KV loaded per path and "
                    "block size, GB (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per rate, after a "
                    "warm-up (default: %(default)s)")
    ap.add_argument("--block-tokens", default="16,128", help="vLLM block sizes, "
                    "comma-separated (default: %(default)s)")
    ap.add_argument("--blocks-per-file", default="1", help="vLLM blocks per store file (the "
                    "connector's blocks_per_file), comma-separated, rows each "
                    "(default: %(default)s)")
    ap.add_argument("--tp", type=int, default=1, choices=(1, 2, 4, 8), help="tensor-parallel "
                    "size: one rank's share of the 8 KV heads (default: %(default)s)")
    ap.add_argument("--paths", default="pe,de", help="pe, de, save (the save path into a "
                    "durable store), comma-separated (default: %(default)s)")
    ap.add_argument("--instances", type=int, default=40, help="router: vLLM instances, half "
                    "prefill (default: %(default)s)")
    ap.add_argument("--waiting", type=int, default=2000, help="router: queued requests "
                    "(default: %(default)s)")
    ap.add_argument("--dir", type=Path, help="where the store goes (default: a temp folder)")
    ap.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (the "
                    "copies'; on a shared 2-core machine more than one slows large copies "
                    "10x) (default: %(default)s)")
    ap.add_argument("--device", default="cpu", help="where the paged KV lives: cpu, or cuda "
                    "(loads staged in pinned memory, NIXL pulls into VRAM) (default: "
                    "%(default)s)")
    ap.add_argument("--json", action="store_true", help="also print the rows as one JSON "
                    "line (for benchmarks/vllm/gpu_check/gpu_check.py)")
    ap.add_argument("--read-threads", type=int, default=16, help="the PE path's parallel "
                    "store reads (KVWorker read_threads) (default: %(default)s)")
    ap.add_argument("--stage-threads", default="16", help="DE path: the staging service's "
                    "store reads in flight (its read_threads); comma-separated, a row each "
                    "(default: %(default)s)")
    ap.add_argument("--de-pull", default="", help="DE path: how the pull reaches the paged "
                    "KV, comma-separated, a row each: direct (NIXL into the pages), bounce "
                    "(NIXL into pinned host buffers, then one copy per layer; the connector's "
                    "default for a GPU's KV) (default: direct,bounce on a GPU, direct on "
                    "the host)")
    ap.add_argument("--stage-gbps", type=float, default=0.0, help="DE path: pace the decode "
                    "node's store reads at this rate, Gb/s (an emulated storage NIC, as the "
                    "P/D benchmark runs it); 0: unpaced, page-cache rate (default: "
                    "%(default)s)")
    ap.add_argument("--pull-blocks", type=int, default=2048, help="DE pull: staged blocks "
                    "whose NIXL descriptors are timed (512 B pages, 64 layers); 0: skip "
                    "(default: %(default)s)")
    args = ap.parse_args()
    if not args.gb > 0 or args.repeats < 1:
        ap.error("--gb must be > 0 and --repeats >= 1")
    paths = [p for p in args.paths.split(",") if p]
    if not set(paths) <= {"pe", "de", "save"}:
        ap.error(f"--paths: {args.paths!r}: pe, de, save, comma-separated")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch sees no CUDA device here")
    de_pulls = [x for x in (args.de_pull or ("direct,bounce" if args.device.startswith("cuda")
                                             else "direct")).split(",") if x]
    if not de_pulls or not set(de_pulls) <= {"direct", "bounce"}:
        ap.error(f"--de-pull: {args.de_pull!r}: direct, bounce or direct,bounce")
    try:
        files_of = [int(x) for x in args.blocks_per_file.split(",") if x]
    except ValueError:
        files_of = []
    if not files_of or min(files_of) < 1:
        ap.error(f"--blocks-per-file: {args.blocks_per_file!r}: integers >= 1")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="connector-bench-", dir=args.dir) as tmp:
        root = Path(tmp)
        rows = []
        for bt in (int(x) for x in args.block_tokens.split(",")):
            shape = Shape(bt, KV_HEADS // args.tp)
            print(f"== {bt}-token blocks: page {shape.page_bytes >> 10} KiB, Full Block "
                  f"{shape.full_block_bytes / 2**20:.1f} MiB", file=sys.stderr, flush=True)
            for g in files_of:
                rows += bench_shape(shape, int(args.gb * GB), args.repeats, paths, root,
                                    args.read_threads, args.device,
                                    [int(x) for x in args.stage_threads.split(",")], de_pulls,
                                    g, args.stage_gbps)
        router = router_cost(args.instances, args.waiting, root)
        counts = {g: prefix_count_cost(root, g) for g in files_of if g > 1}
        pull_s = pull_post_cost(root, args.pull_blocks, max(args.repeats, 5)) \
            if "de" in paths and args.pull_blocks else 0.0
    print(f"70B-shaped KV (64 layers, {KV_HEADS // args.tp} KV heads per rank, head 128, "
          f"bf16) on {args.device}, {args.gb:g} GB per row, median of {args.repeats}, "
          f"torch threads {torch.get_num_threads()}, read threads {args.read_threads}\n")
    print("| block | blocks a file | files | path | GB/s | of plain read | of plain memcpy | "
          "GB per CPU-s | of plain read's |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = {(r["block_tokens"], r["blocks_per_file"], str(r["path"])): r for r in rows}
    for r in rows:
        read = base[(r["block_tokens"], r["blocks_per_file"], "plain read")]
        copy = base[(r["block_tokens"], r["blocks_per_file"], "plain memcpy")]
        rate, per_cpu = float(r["gb_per_s"]), float(r["gb_per_cpu_s"])
        print(f"| {r['block_tokens']} | {r['blocks_per_file']} | {r['files']} | {r['path']} | "
              f"{rate:.2f} | "
              f"{rate / float(read['gb_per_s']):.0%} | {rate / float(copy['gb_per_s']):.0%} | "
              f"{per_cpu:.2f} | {per_cpu / float(read['gb_per_cpu_s']):.0%} |")
    if args.json:
        print(json.dumps({"device": args.device, "rows": rows, "router": router,
                          "pull_post_ms": pull_s * 1e3}))
    if pull_s:
        print(f"\nDE pull of {args.pull_blocks} staged blocks x {LAYERS} layers of 512 B pages"
              f" (NIXL descriptors and posts, after the stage): {pull_s * 1e3:.1f} ms")
    print(f"\nrouter, {router['instances']:.0f} instances, {router['waiting']:.0f} waiting "
          f"32K-token requests: first schedule() {router['first_schedule_ms']:.1f} ms "
          f"({router['placed']:.0f} placed), then {router['event_schedule_ms']:.1f} ms per "
          f"event (median); a 32K prompt's stored prefix (2,047 blocks of 16), one by one / "
          f"in waves on {STAT_THREADS} threads: {router['hit_blocks_32k_ms']:.1f} / "
          f"{router['hit_blocks_32k_waves_ms']:.1f} ms here, "
          f"{router['hit_blocks_32k_nfs_ms']:.0f} / {router['hit_blocks_32k_nfs_waves_ms']:.0f} "
          f"ms with {NFS_STAT_S * 1e3:g} ms per stat (NFS-like); one instance's /metrics page "
          f"({router['metrics_page_kib']:.0f} KiB) parsed in {router['metrics_parse_ms']:.2f} ms")
    for g, c in counts.items():
        print(f"a 32K prompt's stored prefix in files of {g} blocks "
              f"({max_hit_blocks(32_768, 16 * g)} files): {c['_ms']:.1f} / "
              f"{c['_waves_ms']:.1f} ms here, {c['_nfs_ms']:.0f} / {c['_nfs_waves_ms']:.0f} ms "
              f"with {NFS_STAT_S * 1e3:g} ms per stat")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
