"""The worker side of `DualPathConnector`: Full Blocks between vLLM's paged KV and storage.

A Full Block here is one vLLM block of every attention layer: the payload is the layers'
pages in `layer_names` order, each page the bytes of `kv[block_id]` of that layer's paged
tensor (logically `[num_blocks, ...]`; vLLM's CPU backend is `[B, H, N, 2 * head_size]`, K and
V side by side, KV layout LBHNC). Indexing the logical block axis makes this independent of the
physical stride order: a page is copied through a view, never reinterpreted in place.

Per step (`bind` .. `finish_step`), in vLLM's calling order:

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

import json
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from dualpath.core.store import BlockStore
from dualpath.integrations.vllm.connector.plan import BlockTransfer, StepPlan
from dualpath.transport.pacing import Pacer


class LayoutError(ValueError):
    """A paged KV tensor does not match the layout the store was opened for."""


@dataclass
class WorkerCounters:
    """What the worker side has moved since it started."""

    loaded_blocks: int = 0
    load_errors: int = 0
    saved_blocks: int = 0
    skipped_saves: int = 0
    """Blocks planned for saving that were stored already (or belonged to a failed load)."""
    failed_saves: int = 0
    pulled_blocks: int = 0
    """Prefill: DE-side hit blocks pulled from a decode instance's staging buffer."""
    pushed_blocks: int = 0
    """Prefill: blocks written into a decode instance's staging buffer after prefill."""
    xfer_loaded_blocks: int = 0
    """Decode: blocks loaded from this instance's staging buffer."""
    remote_errors: int = 0
    """Side-channel or NIXL failures (each costs a recompute, never a wrong token)."""


_COUNTERS = frozenset(f.name for f in fields(WorkerCounters))


@dataclass
class _Staged:
    block_id: int
    buf: torch.Tensor
    """uint8 [full_block_bytes]."""
    key: bytes = b""


class KVWorker:
    """Moves Full Blocks between a `BlockStore` and vLLM's per-layer paged KV tensors."""

    def __init__(self, store: BlockStore, layer_names: Sequence[str], page_bytes: int,
                 event_log: Path | str | None = None, pacer: Pacer | None = None,
                 background_saves: bool = False, max_pending_saves: int = 64) -> None:
        if store.full_block_bytes != len(layer_names) * page_bytes:
            raise LayoutError(f"store holds {store.full_block_bytes} B blocks, but "
                              f"{len(layer_names)} layers x {page_bytes} B pages were given")
        self.store = store
        self.layer_names = list(layer_names)
        self._layer_index = {name: i for i, name in enumerate(self.layer_names)}
        self.page_bytes = page_bytes
        self.event_log = Path(event_log) if event_log else None
        self.pacer = pacer
        """The emulated storage NIC every store read is charged to (None: unpaced)."""
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        """Guards the counters and the event log (engine and background threads share them)."""
        self.counters = WorkerCounters()
        self._plan = StepPlan()
        self._loaded: list[_Staged] = []
        self._saves: list[_Staged] | None = None
        self._failed_reqs: set[str] = set()
        self._error_block_ids: set[int] = set()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dualpath-save") \
            if background_saves else None
        self.max_pending_saves = max_pending_saves
        self._pending: deque[tuple[Future[None], int]] = deque()
        """Background writes not yet waited for: (future, blocks)."""

    # -- step ------------------------------------------------------------------------------
    def bind(self, plan: StepPlan) -> None:
        """Start a step with the scheduler's plan."""
        self._plan = plan
        self._loaded = []
        self._saves = None
        self._failed_reqs = set()

    def load(self) -> None:
        """Read every planned block from the store into staging (before the layers run)."""
        for t in self._plan.loads:
            n_ok = 0
            for block_id, key in zip(t.block_ids, t.keys, strict=True):
                buf = torch.empty(self.store.full_block_bytes, dtype=torch.uint8)
                if not self.read_block(key, buf):
                    self.report_load_error(t.req_id, block_id)
                    break  # vLLM recomputes from the first failed block on
                self._loaded.append(_Staged(block_id, buf))
                n_ok += 1
            self.count(loaded_blocks=n_ok)
            self._log("load", t, ok=n_ok, error=t.req_id in self._failed_reqs)

    def read_block(self, key: bytes, buf: torch.Tensor) -> bool:
        """One Full Block from the store into `buf` (verified), through the emulated NIC."""
        if self.pacer is None:
            return bool(self.store.get_into(key, buf.numpy()))
        with self.pacer.reading(self.store.full_block_bytes):
            return bool(self.store.get_into(key, buf.numpy()))

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's paged KV tensors, for loads that write whole pages (`load_whole`)."""
        self._kv_caches = dict(kv_caches)

    def write_pages(self, block_id: int, buf: torch.Tensor) -> None:
        """Every layer's page of a staged Full Block into the paged KV."""
        for i, name in enumerate(self.layer_names):
            kv = self._kv_caches[name]
            page = kv[block_id]
            page.copy_(buf[i * self.page_bytes:(i + 1) * self.page_bytes]
                       .view(kv.dtype).view(page.shape))

    def load_whole(self, t: BlockTransfer) -> int:
        """A background load: read `t`'s blocks and write all their pages (the request is not
        running, so no layer waits); returns how many loaded before the first failure."""
        if not self._kv_caches:
            raise LayoutError("load_whole before vLLM registered its KV caches")
        buf = torch.empty(self.store.full_block_bytes, dtype=torch.uint8)
        n_ok = 0
        for block_id, key in zip(t.block_ids, t.keys, strict=True):
            if not self.read_block(key, buf):
                break
            self.write_pages(block_id, buf)
            n_ok += 1
        self.count(loaded_blocks=n_ok)
        self._log("load", t, ok=n_ok, error=n_ok < len(t.block_ids), background=True)
        return n_ok

    def inject(self, layer_name: str, kv: torch.Tensor) -> None:
        """Copy layer `layer_name`'s page of every staged block into its paged KV `kv`."""
        if not self._loaded:
            return
        i = self._layer_of(layer_name, kv)
        lo, hi = i * self.page_bytes, (i + 1) * self.page_bytes
        for s in self._loaded:
            page = kv[s.block_id]
            page.copy_(s.buf[lo:hi].view(kv.dtype).view(page.shape))

    def capture(self, layer_name: str, kv: torch.Tensor) -> None:
        """Copy layer `layer_name`'s page of every block to save out of its paged KV `kv`."""
        if self._saves is None:
            self._saves = self._stage_saves()
        if not self._saves:
            return
        i = self._layer_of(layer_name, kv)
        lo, hi = i * self.page_bytes, (i + 1) * self.page_bytes
        for s in self._saves:
            s.buf[lo:hi].view(kv.dtype).view(kv.shape[1:]).copy_(kv[s.block_id])

    def flush(self) -> None:
        """Write the staged saves (after the forward); every layer must have been captured."""
        saves, self._saves = self._saves or [], None
        self._loaded = []
        if not saves:
            return
        if self._writer is None:
            self._write(saves)
            return
        self._reap(len(saves))
        self._pending.append((self._writer.submit(self._write, saves), len(saves)))

    def _write(self, saves: list[_Staged]) -> None:
        t0 = time.perf_counter()
        for s in saves:
            try:
                is_new = self.store.put(s.key, s.buf.numpy().data, overwrite=False)
            except OSError:
                is_new = None
            if is_new is None:
                self.count(failed_saves=1)
            elif is_new:
                self.count(saved_blocks=1)
            else:
                self.count(skipped_saves=1)
        self.log_event({"event": "save", "blocks": len(saves),
                        "background": self._writer is not None,
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
        if self._writer is not None:
            self._writer.shutdown(wait=True)

    def report_load_error(self, req_id: str, block_id: int) -> None:
        """A block of `req_id` that did not load: vLLM recomputes from it on, and nothing of
        the request is saved in this step."""
        self._failed_reqs.add(req_id)
        self._error_block_ids.add(block_id)
        self.count(load_errors=1)

    def has_failed(self, req_id: str) -> bool:
        """A load of `req_id` failed in this step."""
        return req_id in self._failed_reqs

    def take_load_errors(self) -> set[int]:
        """vLLM block ids that failed to load since the last call."""
        errors, self._error_block_ids = self._error_block_ids, set()
        return errors

    # -- helpers ---------------------------------------------------------------------------
    def _stage_saves(self) -> list[_Staged]:
        staged: list[_Staged] = []
        for t in self._plan.saves:
            for block_id, key in zip(t.block_ids, t.keys, strict=True):
                if t.req_id in self._failed_reqs or self.store.contains(key):
                    self.count(skipped_saves=1)
                    continue
                buf = torch.empty(self.store.full_block_bytes, dtype=torch.uint8)
                staged.append(_Staged(block_id, buf, key))
        return staged

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

    # -- what the P/D data plane (`remote.py`) shares -------------------------------------
    @property
    def full_block_bytes(self) -> int:
        return self.store.full_block_bytes

    def count(self, **deltas: int) -> None:
        """Add `deltas` to the named counters (`WorkerCounters` fields), from any thread."""
        with self._lock:
            for name, n in deltas.items():
                if name not in _COUNTERS:
                    raise AttributeError(f"WorkerCounters has no counter {name!r}")
                setattr(self.counters, name, getattr(self.counters, name) + n)

    def remote_error(self, req_id: str, op: str, error: str, **extra: object) -> None:
        """A side-channel or NIXL failure of `req_id` in `op`: counted and logged (it costs a
        recompute, never a wrong token)."""
        self.count(remote_errors=1)
        self.log_event({"event": "remote_error", "req_id": req_id, "op": op, "error": error,
                        **extra})

    def log_event(self, record: dict[str, object]) -> None:
        """Append `record` (and the counters) to the event log, when there is one."""
        if self.event_log is None:
            return
        with self._lock:
            record = {"t": round(time.time(), 3), **record, "counters": asdict(self.counters)}
            with self.event_log.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
