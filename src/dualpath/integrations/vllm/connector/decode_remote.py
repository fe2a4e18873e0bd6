"""The decode worker's side of DualPath's P/D flow in vLLM (vLLM `kv_consumer`):
`DecodeRemote.load()` looks a request's blocks up in the staging buffer (staged or
committed, under the request's `xfer`; a block whose digest does not match what the prefill
wrote is a load error), `inject(layer)` copies layer `l`'s pages into the paged KV, `flush()`
frees the request's slots."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol

import torch

from dualpath.integrations.vllm.connector.digest import matches
from dualpath.integrations.vllm.connector.kvio import KVWorker
from dualpath.integrations.vllm.connector.pages import scatter_pages
from dualpath.integrations.vllm.connector.side_channel.staging import StagingPool
from dualpath.integrations.vllm.connector.side_channel.wire import SideChannelError
from dualpath.integrations.vllm.connector.step_plan import StepPlan


class Slots(Protocol):
    """A decode node's staging buffer as its worker sees it (`StagingPool` in process,
    `side_channel.client.RemotePool` across the process boundary)."""

    def lookup(self, xfer: str, blocks: Sequence[int]) -> list[int | None]: ...

    def view(self, slot: int) -> torch.Tensor: ...

    def checksums(self, xfer: str, blocks: Sequence[int]) -> list[int | None]: ...

    def release(self, xfer: str) -> None: ...


class DecodeRemote:
    """Loads of a decode worker from its node's staging buffer."""

    def __init__(self, kv: KVWorker, pool: Slots | StagingPool) -> None:
        self.kv = kv
        self.pool = pool
        self._plan = StepPlan()
        self._staged: list[tuple[int, torch.Tensor]] = []
        self._pinned: torch.Tensor | None = None
        """A GPU worker's gathered pages of one layer (reused by every layer and step)."""

    def bind(self, plan: StepPlan) -> None:
        self._plan = plan
        self._staged = []

    def load(self) -> None:
        for x in self._plan.xfer_loads:
            blocks = range(x.first_block, x.first_block + len(x.block_ids))
            try:
                slots = self.pool.lookup(self.kv.shard.xfer(x.xfer), list(blocks))
            except (SideChannelError, OSError) as e:
                self.kv.remote_error(x.req_id, "lookup", str(e))
                slots = [None] * len(blocks)
            crcs = self.pool.checksums(self.kv.shard.xfer(x.xfer), list(blocks))
            ok = 0
            for block_id, slot, crc in zip(x.block_ids, slots, crcs, strict=True):
                if slot is None:
                    self.kv.report_load_error(x.req_id, block_id)
                    break
                view = self.pool.view(slot)
                if crc is not None and not matches(view, crc):
                    self.kv.remote_error(x.req_id, "checksum", f"block {x.first_block + ok}: "
                                         "its slot does not hold what the prefill wrote")
                    self.kv.report_load_error(x.req_id, block_id)
                    break
                self._staged.append((block_id, view))
                ok += 1
            self.kv.count(xfer_loaded_blocks=ok)
            self.kv.log_event({"event": "xfer_load", "req_id": x.req_id, "xfer": x.xfer,
                               "first_block": x.first_block, "blocks": len(x.block_ids),
                               "ok": ok})

    def inject(self, layer_name: str, kv: torch.Tensor) -> None:
        """Layer `layer_name`'s pages of the staged blocks into `kv`: on the host a memcpy per
        page; on a GPU gathered into one pinned buffer, then one copy and one `index_copy_`
        (not a small pageable host-to-device copy per page)."""
        if not self._staged:
            return
        i = self.kv.layer_names.index(layer_name)
        lo, hi = i * self.kv.page_bytes, (i + 1) * self.kv.page_bytes
        if not kv.is_cuda:
            for block_id, buf in self._staged:
                page = kv[block_id]
                page.copy_(buf[lo:hi].view(kv.dtype).view(page.shape))
            return
        n = len(self._staged)
        if self._pinned is None or self._pinned.shape[0] < n:
            self._pinned = torch.empty((n, self.kv.page_bytes), dtype=torch.uint8,
                                       pin_memory=True)
        for j, (_, buf) in enumerate(self._staged):
            self._pinned[j].copy_(buf[lo:hi])
        scatter_pages(kv, [b for b, _ in self._staged], self._pinned[:n], reuses_pages=True)

    def flush(self) -> None:
        for x in self._plan.xfer_loads:
            with contextlib.suppress(SideChannelError, OSError):  # it expires anyway
                self.pool.release(self.kv.shard.xfer(x.xfer))
        self._staged = []
