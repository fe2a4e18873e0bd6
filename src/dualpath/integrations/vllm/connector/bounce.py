"""Bounce buffers: pinned host buffers registered with NIXL, through which a prefill worker
moves the KV of its pulls and pushes when NIXL cannot move VRAM itself.

Without GPUDirect RDMA (no RDMA NIC, or no GDR), UCX has no transport that moves host memory
into or out of VRAM: it emulates such a READ or WRITE over TCP, several times slower than host
to host (docs/measurements.md). So a GPU worker bounces by default (`host_bounce`):
its pulls READ into a registered pinned host buffer, layer-major, and `inject(layer)` copies
the layer's rows into the paged KV (one host-to-device copy, one `index_copy_`:
`pages.scatter_pages`); its pushes gather each layer's pages into such a buffer (one
`index_select`, one device-to-host copy: `pages.gather_pages`) and WRITE from there. The
direct path (NIXL straight into and out of VRAM) is for GPUDirect nodes.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dualpath.integrations.vllm.connector.fit_pool import FitPool
from dualpath.integrations.vllm.connector.step_plan import BACKGROUND_LOAD_THREADS
from dualpath.transport.nixl import NixlAgent, Prepped
from dualpath.transport.transfer_error import TransferError


def host_bounce_option(value: object) -> bool | None:
    """`kv_connector_extra_config.de_pull_via_host` as `PrefillRemote`'s `host_bounce`:
    "auto" (or absent: None, on where the paged KV is on a GPU), "on" / true, "off" / false."""
    if value is None or isinstance(value, bool):
        return value
    choice = {"auto": None, "on": True, "true": True, "off": False, "false": False}
    key = str(value).strip().lower()
    if key not in choice:
        raise ValueError(f"DualPathConnector: kv_connector_extra_config.de_pull_via_host "
                         f"{value!r}: auto, on or off")
    return choice[key]


@dataclass
class Bounce:
    """A pinned host buffer registered with NIXL, layer-major: per layer, `rows` pages
    (`buf[l, r]`), and its prepared list (entry of layer l, row r: `l * rows + r`)."""

    buf: torch.Tensor
    """uint8 [layers, rows, page_bytes]."""
    prepped: Prepped
    rows: int
    event: Any = None
    """A CUDA event after the last copies out of it (waited for before it is refilled)."""

    def copied_out(self, kv: torch.Tensor) -> None:
        """Copies out of this buffer into `kv` were queued on its GPU's current stream: they
        are waited for before the buffer is refilled (nothing for a host `kv`)."""
        if kv.is_cuda:
            self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self.event.record(torch.cuda.current_stream(kv.device))

    def entries(self, first_row: int, n: int) -> npt.NDArray[np.int64]:
        """Per layer, the entries of rows `[first_row, first_row + n)`."""
        layers = np.arange(self.buf.shape[0], dtype=np.int64)[:, None] * self.rows
        return layers + np.arange(first_row, first_row + n, dtype=np.int64)[None, :]


def _bounce_rows(n: int) -> int:
    """A buffer size for `n` rows: the next 2**k or 3 * 2**(k-2) (sizes repeat, at most a
    third unused)."""
    if n <= 2:
        return max(1, n)
    power = 1 << (n - 1).bit_length()
    return power * 3 // 4 if power * 3 // 4 >= n else power


class BouncePool:
    """`Bounce` buffers taken whole and given back (`fit_pool.FitPool`): each is registered with
    NIXL and its list prepared once, when made; the largest `max_kept` free ones are kept."""

    def __init__(self, link: NixlAgent, num_layers: int, page_bytes: int, pinned: bool,
                 max_kept: int = 2 + BACKGROUND_LOAD_THREADS) -> None:
        self.link = link
        self.num_layers = num_layers
        self.page_bytes = page_bytes
        self.pinned = pinned
        self._pool = FitPool[Bounce](size_of=lambda b: b.rows, drop=self._drop,
                                     max_kept=max_kept)
        self._lock = threading.Lock()
        self.num_made = 0
        """Buffers made (each a NIXL registration and a prepared list)."""

    def take(self, rows: int) -> Bounce:
        """A buffer of at least `rows` rows (the smallest free one that fits, else a new one),
        its earlier copies done."""
        b = self._pool.take(rows, lambda: self._make(_bounce_rows(rows)))
        if b.event is not None:
            b.event.synchronize()
            b.event = None
        return b

    def give(self, b: Bounce) -> None:
        """Give `b` back (its copies to a GPU, `Bounce.copied_out`, are waited for before it
        is taken again)."""
        self._pool.give(b)

    def _make(self, rows: int) -> Bounce:
        nbytes = self.num_layers * rows * self.page_bytes
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        address = int(buf.data_ptr())
        self.link.register([(address, nbytes)])
        try:
            prepped = self.link.prep(np.uint64(address) + np.arange(
                self.num_layers * rows, dtype=np.uint64) * np.uint64(self.page_bytes),
                self.page_bytes)
        except TransferError:
            self.link.deregister([(address, nbytes)])
            raise
        with self._lock:
            self.num_made += 1
        return Bounce(buf.view(self.num_layers, rows, self.page_bytes), prepped, rows)

    def _drop(self, b: Bounce) -> None:
        if b.event is not None:
            b.event.synchronize()
        self.link.release(b.prepped)
        with contextlib.suppress(TransferError):
            self.link.deregister([(int(b.buf.data_ptr()), b.buf.numel())])

    def close(self) -> None:
        self._pool.close()
