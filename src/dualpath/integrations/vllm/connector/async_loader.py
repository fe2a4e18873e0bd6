"""A prefill worker's background loads (vLLM's `load_kv_async`): `AsyncLoader`."""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from dualpath.integrations.vllm.connector.kvio import KVWorker
from dualpath.integrations.vllm.connector.remote import PrefillRemote
from dualpath.integrations.vllm.connector.step_plan import (
    BACKGROUND_LOAD_THREADS,
    BlockTransfer,
    RemoteLoad,
    StepPlan,
)


class AsyncLoader:
    """Background loads of a prefill worker (`StepPlan.async_loads` / `async_remote_loads`):
    the PE-side store reads and the DE-side pulls of a request run in parallel threads, other
    requests' too, while the engine keeps stepping; a request is reported finished (vLLM's
    `finished_recving`) once all its parts are done, its failed blocks no later than that.

    Each read path has threads of its own (`max_workers` for this node's store, as many for
    each decode node): with one shared pool, a burst of PE-side loads (each waiting seconds
    for its emulated NIC) took every thread, and the DE-side stages queued behind them
    instead of reading in parallel on the decode node's NIC."""

    def __init__(self, kv: KVWorker, prefill: PrefillRemote,
                 max_workers: int = BACKGROUND_LOAD_THREADS) -> None:
        self.kv = kv
        self.prefill = prefill
        self.max_workers = max_workers
        self._pools: dict[str, ThreadPoolExecutor] = {}
        """"" (this node's store) or a decode node's side channel -> its threads."""
        self._lock = threading.Lock()
        self._outstanding: dict[str, int] = {}
        self._finished: set[str] = set()
        self._errors: set[int] = set()
        self._queued = {"pe": 0, "de": 0}
        """Blocks submitted and not yet done, per read path (the read queues' depth)."""

    def submit(self, plan: StepPlan) -> None:
        jobs: dict[str, list[BlockTransfer | RemoteLoad]] = defaultdict(list)
        for t in plan.async_loads:
            jobs[t.req_id].append(t)
        for r in plan.async_remote_loads:
            jobs[r.blocks.req_id].append(r)
        with self._lock:
            for req_id, parts in jobs.items():
                self._outstanding[req_id] = self._outstanding.get(req_id, 0) + len(parts)
                for part in parts:
                    self._queued[_side(part)] += _num_blocks(part)
        for req_id, parts in jobs.items():
            for part in parts:
                self._pool(part.de if isinstance(part, RemoteLoad) else "").submit(
                    self._run, req_id, part)

    def _pool(self, path: str) -> ThreadPoolExecutor:
        with self._lock:
            pool = self._pools.get(path)
            if pool is None:
                pool = self._pools[path] = ThreadPoolExecutor(
                    max_workers=self.max_workers,
                    thread_name_prefix="dualpath-load" if not path else "dualpath-pull")
            return pool

    def _run(self, req_id: str, part: BlockTransfer | RemoteLoad) -> None:
        t = part if isinstance(part, BlockTransfer) else part.blocks
        ok = 0
        try:
            ok = self.kv.load_whole(t) if isinstance(part, BlockTransfer) \
                else self.prefill.pull_whole(part)
        except Exception as e:  # a bug must not hang the request: it is recomputed
            self.kv.log_event({"event": "remote_error", "req_id": req_id, "op": "load",
                               "error": f"{type(e).__name__}: {e}"})
        if ok < len(t.block_ids):
            self.prefill.note_failure(req_id, t.first_block + ok)
        with self._lock:
            self._queued[_side(part)] -= len(t.block_ids)
            if ok < len(t.block_ids):
                self._errors.add(t.block_ids[ok])
                self.kv.count(load_errors=1)
            self._outstanding[req_id] -= 1
            if self._outstanding[req_id] == 0:
                del self._outstanding[req_id]
                self._finished.add(req_id)

    def take_finished(self) -> set[str]:
        with self._lock:
            done, self._finished = self._finished, set()
        return done

    def queued_blocks(self) -> dict[str, int]:
        """Blocks of background loads not yet done, per read path ("pe", "de")."""
        with self._lock:
            return dict(self._queued)

    def take_errors(self) -> set[int]:
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        with self._lock:
            pools = list(self._pools.values())
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)


def _side(part: BlockTransfer | RemoteLoad) -> str:
    return "de" if isinstance(part, RemoteLoad) else "pe"


def _num_blocks(part: BlockTransfer | RemoteLoad) -> int:
    return len(part.blocks.block_ids if isinstance(part, RemoteLoad) else part.block_ids)
