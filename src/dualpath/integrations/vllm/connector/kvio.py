"""The worker side of `DualPathConnector`: Full Blocks between vLLM's paged KV and storage.

A Full Block here is one vLLM block of every attention layer: the layers' pages in
`layer_names` order, each page the bytes of `kv[block_id]` of that layer's paged tensor
(logically `[num_blocks, ...]`; vLLM's CPU backend is `[B, H, N, 2 * head_size]`, K and V side
by side, KV layout LBHNC). Indexing the logical block axis makes this independent of the
physical stride order: a page is copied through a view, never reinterpreted in place. A store
file holds `blocks_per_file` (g) of them back to back (block-major: block 0's layers, then
block 1's, ...; `step_plan.BlockTransfer.files`), so a file is read with one scatter `preadv`
straight into the g blocks' pages and written from g consecutive rows of a save buffer; with
g = 1 a file is one Full Block.

Per step (`bind` .. `flush`), in vLLM's calling order:

1. `load()` before the forward: every planned block is read from the store into a staging
   Full Block (one `preadv`, CRC32C verified). A block that is missing or corrupt (the store
   removes a corrupt file) is a load error; the request's later blocks are not read, since
   vLLM recomputes from the first failed block on (`kv_load_failure_policy="recompute"`).
2. `inject(layer, kv)` just before a layer's attention runs: that layer's page of every staged
   block is copied into the paged KV (the layer-by-layer half of the PE read path).
3. `capture(layer, kv)` just after a layer's attention: that layer's page of every block to
   save is copied into a staging Full Block. Blocks already stored are skipped, and so is every
   block of a request with a load error in this step (its KV is recomputed next step).
4. `flush()` after the forward: staged saves are written (atomic, checksummed); a failed put
   is counted and the block is a later miss. With `background_saves` the writes (and their
   fsyncs) go to one writer thread instead, so the step does not wait for the disk: the
   pages were copied out in `capture`, vLLM may reuse the blocks at once, and a later request
   sees a block as stored only once its file is complete (the store's atomic rename). At most
   `max_pending_saves` blocks wait; a step that would exceed that waits for the oldest.
   `drain()` waits for them all (the connector's shutdown).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dualpath.integrations.vllm.connector.fit_pool import FitPool
from dualpath.integrations.vllm.connector.pages import (
    LayoutError,
    gather_pages,
    scatter_pages,
    wait_for_device,
)
from dualpath.integrations.vllm.connector.step_plan import BlockTransfer, StepPlan
from dualpath.integrations.vllm.connector.worker_record import WorkerRecord
from dualpath.integrations.vllm.manifest import Shard
from dualpath.store import BlockStore
from dualpath.transport.pacing import Pacer


@dataclass
class _Saves:
    """A step's blocks to save: their pages gathered block-major into `rows` (one Full Block
    per row; a file's g consecutive rows are what `BlockStore.put` takes), handed to the
    writers after the forward."""

    block_ids: list[int]
    keys: list[bytes]
    """One per file (of `blocks_per_file` rows)."""
    buf: torch.Tensor
    """The staging buffer the rows live in (given back once every row is written)."""
    rows: torch.Tensor
    """uint8 [len(block_ids), full_block_bytes]."""
    ids: dict[torch.device, torch.Tensor]
    """`block_ids` as an index tensor on each device a layer lives on."""
    num_unwritten: int = 0


class KVWorker(WorkerRecord):
    """Moves Full Blocks between a `BlockStore` and vLLM's per-layer paged KV tensors.

    Copies are batched: a step's loads are read straight into the paged KV where it is host
    memory with contiguous pages (one scatter `preadv` per block, no copy), else into one
    layer-major staging buffer (pinned) from which each layer's pages of every block go in
    one `index_copy_`; a step's saves leave each layer's pages in one `index_select`. Reads
    run `read_threads` at a time, writes `write_threads` at a time."""

    def __init__(self, store: BlockStore, layer_names: Sequence[str], page_bytes: int,
                 event_log: Path | str | None = None, pacer: Pacer | None = None,
                 background_saves: bool = False, max_pending_saves: int = 64,
                 shard: Shard | None = None, read_threads: int = 16,
                 write_threads: int = 4, blocks_per_file: int = 1) -> None:
        if blocks_per_file < 1:
            raise LayoutError(f"blocks_per_file must be >= 1, got {blocks_per_file}")
        if store.full_block_bytes != blocks_per_file * len(layer_names) * page_bytes:
            raise LayoutError(f"store holds {store.full_block_bytes} B files, but "
                              f"{blocks_per_file} blocks x {len(layer_names)} layers x "
                              f"{page_bytes} B pages were given")
        self.store = store
        self.blocks_per_file = blocks_per_file
        """g: vLLM blocks per store file."""
        self.layer_names = list(layer_names)
        self._layer_index = {name: i for i, name in enumerate(self.layer_names)}
        self.page_bytes = page_bytes
        super().__init__(event_log)
        self.pacer = pacer
        """The emulated storage NIC every store read is charged to (None: unpaced)."""
        self.shard = shard or Shard()
        """This worker's part of each block (TP rank, PP stage): the plan's block keys are
        rank-agnostic, every store access goes through `shard.key` (its own files)."""
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._page_rows: list[Any] | None = None
        """Per layer, its pages as a numpy [blocks, page_bytes] view (host KV with contiguous
        pages: loads read straight into them), else None."""
        self._plan = StepPlan()
        self._buffers = FitPool[torch.Tensor](size_of=torch.Tensor.numel)
        """Reusable uint8 staging buffers (pinned where the paged KV is on a GPU, so copies
        to it are DMA): no step allocates fresh memory per block (`_take_buffer`)."""
        self._loaded_ids: list[int] = []
        """vLLM block ids of this step's loads, in staging row order."""
        self._staging: torch.Tensor | None = None
        """This step's loads, layer-major uint8 [layers, rows, page_bytes] (None: read in
        place, or nothing loaded)."""
        self._staging_buf: torch.Tensor | None = None
        self._loaded_index: dict[torch.device, torch.Tensor] = {}
        self._saves: _Saves | None = None
        self._saves_planned = False
        self._readers = ThreadPoolExecutor(max_workers=max(1, read_threads),
                                           thread_name_prefix="dualpath-read")
        self._writers = ThreadPoolExecutor(max_workers=max(1, write_threads),
                                           thread_name_prefix="dualpath-save")
        self.write_threads = max(1, write_threads)
        self.is_background = background_saves
        self.max_pending_saves = max_pending_saves
        self._pending: deque[tuple[Future[None], int]] = deque()
        """Background writes not yet waited for: (future, blocks)."""

    # -- step ------------------------------------------------------------------------------
    def bind(self, plan: StepPlan) -> None:
        """Start a step with the scheduler's plan."""
        self._plan = plan
        self._release_staging()
        self._saves = None
        self._saves_planned = False
        self._failed_reqs = set()

    def load(self) -> None:
        """Read every planned block from the store (before the layers run): into the paged
        KV itself where it is host memory with contiguous pages, else into staging. Reads run
        in parallel; a request's blocks from its first failed one on are not used."""
        loads = [(t, b) for t in self._plan.loads for b in t.block_ids]
        if not loads:
            return
        first_row: list[int] = []
        """Per transfer (in plan order), the staging row of its first block."""
        files: list[tuple[int, bytes, list[int | None]]] = []
        """(transfer, key, rows: `BlockTransfer.files`) of every file to read."""
        for n, t in enumerate(self._plan.loads):
            first_row.append(first_row[-1] + len(self._plan.loads[n - 1].block_ids) if n else 0)
            files += [(n, key, rows) for key, rows in t.files()]
        in_place = self._page_rows is not None
        staging = None
        if not in_place:
            pinned = self._is_cuda()
            self._staging_buf = self._take_buffer(len(loads) * self.full_block_bytes, pinned)
            staging = self._staging_buf[:len(loads) * self.full_block_bytes].view(
                len(self.layer_names), len(loads), self.page_bytes)

        # Each read's per-layer pieces are numpy views of one numpy array: a torch index and
        # `.numpy()` per piece hold the GIL for every layer of every block, which serializes
        # the reader threads.
        staging_np = staging.numpy() if staging is not None else None

        def read(n: int, key: bytes, rows: list[int | None]) -> bool:
            if staging_np is not None:
                base = first_row[n]
                return self.read_block(key, self._file_pages(
                    rows, lambda i, r: staging_np[i, base + r]))
            pages = self._page_rows
            assert pages is not None
            ids = self._plan.loads[n].block_ids
            return self.read_block(key, self._file_pages(
                rows, lambda i, r: pages[i][ids[r]]))

        done = self._map(self._readers, read, files)
        ok_rows: list[int] = []
        n_ok = 0
        for f, ((n, _, rows), is_read) in enumerate(zip(files, done, strict=True)):
            t = self._plan.loads[n]
            if t.req_id not in self._failed_reqs:
                mine = [r for r in rows if r is not None]
                if is_read:
                    ok_rows += [first_row[n] + r for r in mine]
                    n_ok += len(mine)
                else:  # recomputed from the file's first block on
                    self.report_load_error(t.req_id, t.block_ids[mine[0]])
            if f + 1 == len(files) or files[f + 1][0] != n:  # the transfer's last file
                self.count(loaded_blocks=n_ok)
                self._log("load", t, ok=n_ok, error=t.req_id in self._failed_reqs)
                n_ok = 0
        self._loaded_ids = [loads[r][1] for r in ok_rows]
        if staging is not None:
            self._staging = staging[:, ok_rows] if len(ok_rows) < len(loads) else staging
        self._loaded_index = {}

    def _file_pages(self, rows: list[int | None], page: Callable[[int, int], Any]
                    ) -> list[Any]:
        """The buffers a file is read into, in its payload order (block-major, then layer):
        `page(layer, row)` for a block the transfer takes (`rows`: `BlockTransfer.files`),
        scratch for one it does not."""
        num_layers = len(self.layer_names)
        dropped = sum(r is None for r in rows)
        scratch = iter(np.empty((dropped, num_layers, self.page_bytes), np.uint8))
        out: list[Any] = []
        for r in rows:
            out += list(next(scratch)) if r is None else [page(i, r) for i in range(num_layers)]
        return out

    def read_block(self, key: bytes, out: Any) -> bool:
        """This shard of file `key` from the store into `out` (a buffer, or a list of
        buffers filled in order), verified, through the emulated NIC."""
        key = self.shard.key(key)
        if isinstance(out, torch.Tensor):
            out = out.numpy()
        if self.pacer is None:
            return bool(self.store.get_into(key, out))
        with self.pacer.reading(self.store.full_block_bytes):
            return bool(self.store.get_into(key, out))

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's paged KV tensors: loads go straight into them where they are host memory
        with contiguous pages, and background loads (`load_whole`) write whole pages."""
        self._kv_caches = dict(kv_caches)
        rows = []
        for name in self.layer_names:
            kv = self._kv_caches.get(name)
            if kv is None or kv.is_cuda or kv.dim() < 2 or not kv[0].is_contiguous() \
                    or kv[0].numel() * kv.element_size() != self.page_bytes:
                self._page_rows = None
                return
            u8 = kv.view(torch.uint8)
            rows.append(torch.as_strided(u8, (kv.shape[0], self.page_bytes),
                                         (u8.stride(0), 1)).numpy())
        self._page_rows = rows

    def load_whole(self, t: BlockTransfer) -> int:
        """A background load: read `t`'s blocks and write all their pages (the request is not
        running, so no layer waits); returns how many loaded before the first failure."""
        if not self._kv_caches:
            raise LayoutError("load_whole before vLLM registered its KV caches")
        pages = self._page_rows
        if pages is not None:
            n_ok = self._read_files(t, lambda i, r: pages[i][t.block_ids[r]])
        else:
            n_ok = self._load_whole_staged(t)
        self.count(loaded_blocks=n_ok)
        self._log("load", t, ok=n_ok, error=n_ok < len(t.block_ids), background=True)
        return n_ok

    def _load_whole_staged(self, t: BlockTransfer) -> int:
        n, num_layers = len(t.block_ids), len(self.layer_names)
        buf = self._take_buffer(n * self.full_block_bytes, self._is_cuda())
        try:
            staging = buf[:n * self.full_block_bytes].view(num_layers, n, self.page_bytes)
            staging_np = staging.numpy()
            n_ok = self._read_files(t, lambda i, r: staging_np[i, r])
            if n_ok:
                first = self._kv_caches[self.layer_names[0]]
                stream = torch.cuda.Stream(first.device) if first.is_cuda else None  # type: ignore[no-untyped-call]
                with torch.cuda.stream(stream) if stream is not None \
                        else contextlib.nullcontext():
                    for i, name in enumerate(self.layer_names):
                        scatter_pages(self._kv_caches[name], t.block_ids[:n_ok],
                                       staging[i, :n_ok])
                if stream is not None:
                    stream.synchronize()
            return n_ok
        finally:
            self._buffers.give(buf)

    def _read_files(self, t: BlockTransfer, page: Callable[[int, int], Any]) -> int:
        """Read `t`'s files one after another (`page(layer, row)`: where block `row` of `t`
        goes); returns its blocks read before the first file that failed."""
        n_ok = 0
        for key, rows in t.files():
            if not self.read_block(key, self._file_pages(rows, page)):
                break
            n_ok += sum(r is not None for r in rows)
        return n_ok

    def inject(self, layer_name: str, kv: torch.Tensor) -> None:
        """Copy layer `layer_name`'s page of every staged block into its paged KV `kv`: one
        batched copy (nothing when the loads were read in place)."""
        if self._staging is None or not self._loaded_ids:
            return
        i = self._layer_of(layer_name, kv)
        ids = self._loaded_index.get(kv.device)
        if ids is None:
            ids = self._loaded_index[kv.device] = torch.tensor(self._loaded_ids,
                                                               device=kv.device)
        scatter_pages(kv, ids, self._staging[i])

    def capture(self, layer_name: str, kv: torch.Tensor) -> None:
        """Copy layer `layer_name`'s page of every block to save out of its paged KV `kv`: one
        batched gather."""
        if not self._saves_planned:
            self._saves = self._stage_saves()
            self._saves_planned = True
        saves = self._saves
        if saves is None:
            return
        i = self._layer_of(layer_name, kv)
        ids = saves.ids.get(kv.device)
        if ids is None:
            ids = saves.ids[kv.device] = torch.tensor(saves.block_ids, device=kv.device)
        lo = i * self.page_bytes
        gather_pages(kv, ids, saves.rows[:, lo:lo + self.page_bytes])

    def flush(self) -> None:
        """Write the staged saves (after the forward); every layer must have been captured."""
        saves, self._saves = self._saves, None
        self._saves_planned = False
        self._release_staging()
        if saves is None:
            return
        chunks = _chunks(range(len(saves.keys)), self.write_threads)
        saves.num_unwritten = len(chunks)
        futures = [self._writers.submit(self._write, saves, rows) for rows in chunks]
        if not self.is_background:
            for f in futures:
                f.result()
            return
        self._reap(len(saves.block_ids))
        for f, files in zip(futures, chunks, strict=True):
            self._pending.append((f, len(files) * self.blocks_per_file))

    def _write(self, saves: _Saves, files: range) -> None:
        """Write files `files` of `saves` (file f: rows `[f * g, (f + 1) * g)`); the
        counters count blocks."""
        t0 = time.perf_counter()
        g = self.blocks_per_file
        for f in files:
            try:
                is_new = self.store.put(saves.keys[f],
                                        saves.rows[f * g:(f + 1) * g].reshape(-1).numpy().data,
                                        overwrite=False)
            except OSError:
                is_new = None
            if is_new is None:
                self.count(failed_saves=g)
            elif is_new:
                self.count(saved_blocks=g)
            else:
                self.count(skipped_saves=g)
        with self._lock:
            saves.num_unwritten -= 1
            is_last = saves.num_unwritten == 0
        if is_last:
            self._buffers.give(saves.buf)
        self.log_event({"event": "save", "blocks": len(files) * g, "files": len(files),
                        "background": self.is_background,
                        "s": round(time.perf_counter() - t0, 4)})

    def _reap(self, adding: int) -> None:
        """Forget finished background writes; wait for the oldest while more than
        `max_pending_saves` blocks (with `adding` more) would be waiting."""
        while self._pending and (self._pending[0][0].done() or sum(
                n for _, n in self._pending) + adding > self.max_pending_saves):
            self._pending.popleft()[0].result()

    def drain(self) -> None:
        """Wait for every background write (their failures are counted, not raised)."""
        while self._pending:
            self._pending.popleft()[0].result()

    def close(self) -> None:
        self.drain()
        self._writers.shutdown(wait=True)
        self._readers.shutdown(wait=True)

    # -- helpers ---------------------------------------------------------------------------
    def _take_buffer(self, nbytes: int, pinned: bool) -> torch.Tensor:
        return self._buffers.take(
            nbytes, lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned),
            lambda b: b.is_pinned() == pinned)

    def _is_cuda(self) -> bool:
        return any(kv.is_cuda for kv in self._kv_caches.values())

    def _release_staging(self) -> None:
        if self._staging_buf is not None:
            if self._is_cuda():  # the last step's copies from it may still be queued
                wait_for_device(next(iter(self._kv_caches.values())))
            self._buffers.give(self._staging_buf)
        self._staging_buf = None
        self._staging = None
        self._loaded_ids = []
        self._loaded_index = {}

    def _map(self, pool: ThreadPoolExecutor, fn: Any, args: list[tuple[Any, ...]]
             ) -> list[bool]:
        if len(args) == 1:
            return [bool(fn(*args[0]))]
        return [bool(f.result()) for f in [pool.submit(fn, *a) for a in args]]

    def _stage_saves(self) -> _Saves | None:
        """The step's saves (not of a request whose load failed: it is recomputed). Blocks
        stored already are found by the writers (`put` without overwrite), not by a `stat`
        per block here, inside the forward."""
        block_ids: list[int] = []
        keys: list[bytes] = []
        for t in self._plan.saves:
            if not t.is_aligned or t.blocks_per_file != self.blocks_per_file:
                raise ValueError(f"{t.req_id}: a save of blocks from {t.first_block} "
                                 f"({len(t.block_ids)}) is not whole files of "
                                 f"{self.blocks_per_file} blocks")
            if t.req_id in self._failed_reqs:
                self.count(skipped_saves=len(t.block_ids))
                continue
            block_ids.extend(t.block_ids)
            keys.extend(self.shard.key(k) for k in t.keys)
        if not block_ids:
            return None
        n = len(block_ids)
        buf = self._take_buffer(n * self.full_block_bytes, self._is_cuda())
        return _Saves(block_ids, keys, buf,
                      buf[:n * self.full_block_bytes].view(n, self.full_block_bytes), {})

    def _layer_of(self, layer_name: str, kv: torch.Tensor) -> int:
        i = self._layer_index.get(layer_name)
        if i is None:
            raise LayoutError(f"layer {layer_name!r} is not one of the store's layers")
        got = kv[0].numel() * kv.element_size()
        if got != self.page_bytes:
            raise LayoutError(f"layer {layer_name!r}: a page of {tuple(kv.shape[1:])} "
                              f"{kv.dtype} is {got} B, the store expects {self.page_bytes} B")
        return i

    def _log(self, event: str, t: BlockTransfer, **extra: object) -> None:
        self.log_event({"event": event, "req_id": t.req_id, "first_block": t.first_block,
                         "blocks": len(t.block_ids), **extra})

    # -- what the P/D data plane (`remote`, `decode_remote`, `staged_pull`) shares -------
    @property
    def full_block_bytes(self) -> int:
        """One vLLM block's pages, every layer (a staging slot, a row of a buffer)."""
        return len(self.layer_names) * self.page_bytes

    @property
    def file_bytes(self) -> int:
        """One store file: `blocks_per_file` Full Blocks."""
        return self.store.full_block_bytes


def _chunks(rows: range, n: int) -> list[range]:
    """`rows` in at most `n` consecutive runs of near-equal length."""
    size = -(-len(rows) // max(1, n)) if len(rows) else 1
    return [rows[i:i + size] for i in range(0, len(rows), size)]
