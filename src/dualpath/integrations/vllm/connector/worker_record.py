"""What a connector worker reports: its counters and its event log (from any of its threads:
the engine's, background loads', writers'), and the requests and blocks whose load failed in
this step (vLLM recomputes them). `kvio.KVWorker` is one; the P/D data plane (`remote`,
`decode_remote`, `staged_pull`, `async_loader`) reports through it."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path


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


class WorkerRecord:
    """Counters and event log (from any thread), and the step's failed loads (from the engine
    thread)."""

    def __init__(self, event_log: Path | str | None = None) -> None:
        self.event_log = Path(event_log) if event_log else None
        self._lock = threading.Lock()
        """Guards the counters and the event log (engine and background threads share them)."""
        self.counters = WorkerCounters()
        self._failed_reqs: set[str] = set()
        self._error_block_ids: set[int] = set()

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
