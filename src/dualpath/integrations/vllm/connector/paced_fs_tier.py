"""vLLM's filesystem KV tier behind an emulated storage NIC, for the stock baseline
(`cluster.stock`): `PacedFileSystemTier` is vLLM 0.32's `FileSystemTierManager` unchanged
except that each load job holds its thread until a token bucket of `storage_read_gbps` (one
per instance: the tier lives in the engine-core process) has carried the bytes it read, as the
DualPath connector's storage reads do (`transport.pacing.Pacer.reading`: a read costs
max(I/O, NIC time), and the bucket is FIFO over all of the instance's reads). Stores are
unpaced, as the connector's are.

Configured as an out-of-tree secondary tier of `TieringOffloadingSpec`:
`{"type": "PacedFileSystemTier", "module_path": <this module>, "root_dir": ...,
"storage_read_gbps": ...}`. It wraps the tier's thread pool's `enqueue_load`, which vLLM's
`submit_load` calls once per job with one task after recording the job's block count: private
names of vLLM 0.32 (`_pool`, `_job_block_counts`, `_block_size`), checked by
`make vllm-typecheck` and `tests/integrations/vllm/cluster/test_stock.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from vllm.v1.kv_offload.tiering.base import JobId
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

from dualpath.transport.pacing import Pacer


class PacedFileSystemTier(FileSystemTierManager):  # type: ignore[misc]
    """`FileSystemTierManager` whose loads are held to `storage_read_gbps` (Gb/s)."""

    def __init__(self, *, storage_read_gbps: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pacer = Pacer.from_gbps(float(storage_read_gbps), "storage_read")
        enqueue = self._pool.enqueue_load

        def enqueue_paced(job_id: JobId, n_tasks: int, tasks: Iterable[Callable[[], Any]]
                          ) -> None:
            num_bytes = self._job_block_counts.get(job_id, 0) * self._block_size
            tasks = list(tasks)
            share = num_bytes // max(len(tasks), 1)
            enqueue(job_id, n_tasks, [self._paced(t, share) for t in tasks])

        self._pool.enqueue_load = enqueue_paced  # type: ignore[method-assign]

    def _paced(self, task: Callable[[], Any], num_bytes: int) -> Callable[[], None]:
        def run() -> None:
            with self.pacer.reading(num_bytes):
                task()
        return run
