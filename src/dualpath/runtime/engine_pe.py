"""Prefill engine (PE): runs a request's prompt layer by layer and ships its KV to the DE.

Per request (paper Fig. 4; slot i of the PE buffer mirrors slot i of the DE buffer, block i):

- PE read path, hit blocks `[0, num_pe_blocks)`: storage -> PE buffer (node reader, storage
  NIC; steps 1-2), then per layer PE buffer -> engine memory through the engine's compute NIC
  (tx + rx: the CNIC-assisted H2D copy, steps 3-4).
- DE read path, hit blocks `[num_pe_blocks, num_hit)`: already in the DE buffer; per layer
  DE buffer -> PE over the compute network (a transfer-engine READ charged to the PE's rx,
  steps 3-5 of Fig. 4b).
- After layer l runs, its KV goes to the DE buffer (a WRITE charged to the PE's tx): every
  block the DE buffer does not already hold, i.e. PE-path hit blocks and the miss tokens
  (PE path steps 5-7); on the DE path only the miss tokens.

With `is_layerwise`, layer l+1's cached KV is fetched while layer l computes and layer l's KV
ships while layer l+1 computes (two helper threads); without it (the Basic baseline) all cached
KV is loaded before the forward pass starts.

Block-state invariant: a hit block is in exactly one of "being read into a buffer", "in the PE
(or DE) buffer", "in PE engine memory" (the gathered layer tensor) at a time; PE buffer slots
are freed only after every layer of the request has been written to the DE buffer.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from dualpath.runtime.messages import (
    DeBufferReady,
    EngineLoad,
    Message,
    PrefillDone,
    PrefillTask,
    RemoteCharge,
)
from dualpath.runtime.model import SamplingParams, sample_token
from dualpath.runtime.node import NodeContext, ReadJob


@dataclass
class _PeRequest:
    task: PrefillTask
    read: ReadJob
    de_ready: DeBufferReady | None = None
    is_ready: threading.Event = field(default_factory=threading.Event)

    @property
    def is_runnable(self) -> bool:
        return self.read.done.is_set() and self.de_ready is not None


class PrefillEngine:
    """One PE (an engine thread of a prefill node)."""

    def __init__(self, ctx: NodeContext, engine_id: int, model: Any) -> None:
        self.ctx = ctx
        self.engine_id = engine_id
        self.model = model
        self._index = ctx.engine_index(engine_id)
        self._cond = threading.Condition()
        self._queue: list[_PeRequest] = []
        self._is_stopping = False
        self._num_tokens = 0
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix=f"pe{engine_id}-fetch")
        self._shipper = ThreadPoolExecutor(1, thread_name_prefix=f"pe{engine_id}-ship")

    # -- node loop side --------------------------------------------------------------------
    def on_message(self, msg: Message) -> None:
        if isinstance(msg, PrefillTask):
            self._accept(msg)
        elif isinstance(msg, DeBufferReady):
            with self._cond:
                for req in self._queue:
                    if req.task.request_id == msg.request_id:
                        req.de_ready = msg
                self._cond.notify_all()
        else:
            raise RuntimeError(f"PE {self.engine_id}: unexpected message {msg!r}")

    def _accept(self, task: PrefillTask) -> None:
        bs = self.ctx.layout.block_size
        job = ReadJob(
            request_id=task.request_id,
            num_slots=self.ctx.layout.num_blocks(len(task.token_ids)),
            blocks=[(i, task.block_keys[i]) for i in range(task.num_pe_blocks)],
            block_size=bs,
            on_done=lambda _job: self._wake(),
        )
        with self._cond:
            self._queue.append(_PeRequest(task, job))
            self._num_tokens += len(task.token_ids)
        self.ctx.add_read_q(task.num_pe_blocks * bs)
        self.ctx.read_queue.put(job)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def load(self) -> EngineLoad:
        with self._cond:
            return EngineLoad(
                engine_id=self.engine_id,
                num_seqs=len(self._queue),
                num_tokens=self._num_tokens,
                read_q_tokens=self.ctx.read_q_tokens,
                free_hbm_bytes=self.ctx.cfg.hbm_bytes,
            )

    def stop(self) -> None:
        with self._cond:
            self._is_stopping = True
            self._cond.notify_all()

    # -- engine thread ---------------------------------------------------------------------
    def run(self) -> None:
        """Prefill runnable requests in FIFO order among those whose reads are done (a request
        waiting for its DE buffer never blocks one behind it that is ready)."""
        try:
            while True:
                with self._cond:
                    req = next((r for r in self._queue if r.is_runnable), None)
                    while req is None and not self._is_stopping:
                        self._cond.wait(timeout=0.05)
                        req = next((r for r in self._queue if r.is_runnable), None)
                    if req is None:
                        return
                with torch.inference_mode():
                    self._prefill(req)
                with self._cond:
                    self._queue.remove(req)
                    self._num_tokens -= len(req.task.token_ids)
        finally:
            self._fetcher.shutdown(wait=False)
            self._shipper.shutdown(wait=False)

    def _prefill(self, req: _PeRequest) -> None:
        ctx, lay, task = self.ctx, self.ctx.layout, req.task
        de = req.de_ready
        assert de is not None
        started_at = time.time()
        tx, rx = ctx.nics.compute_tx[self._index], ctx.nics.compute_rx[self._index]
        slots = req.read.slots
        num_pe = task.num_pe_blocks
        # A missing or corrupt block ends the usable hit: everything after it is recomputed.
        if req.read.num_valid_blocks < num_pe:
            num_hit = req.read.num_valid_blocks
        else:
            num_hit = num_pe + de.num_valid_de_blocks
        num_hit = min(num_hit, task.num_hit_blocks)
        hit_tokens = num_hit * lay.block_size
        num_pe_hit = min(num_pe, num_hit)
        de_side = range(num_pe_hit, num_hit)
        ship = [i for i in range(len(slots)) if not num_pe_hit <= i < num_hit]
        lbb = lay.layer_block_bytes
        bpl = lay.kv_bytes_per_token_per_layer

        def fetch(layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            start, _ = lay.layer_byte_range(layer)
            if de_side:
                descs = [
                    (ctx.pool.offset(slots[i]) + start, de.slot_offsets[i] + start, lbb)
                    for i in de_side
                ]
                ctx.transfer.read(task.de_node, descs)
                ctx.charge([rx], len(descs) * lbb, "de_to_pe")
            if num_pe_hit:
                ctx.charge([tx, rx], num_pe_hit * lay.block_size * bpl, "h2d")
            if not num_hit:
                return None, None
            blocks = [ctx.pool.slot(slots[i]) for i in range(num_hit)]
            # Straight from the buffer slots into engine memory (pinned slots on CUDA).
            shape = (hit_tokens, 2, lay.num_kv_heads, lay.head_dim)
            out = torch.empty(shape, dtype=lay.torch_dtype, device=self.model.device)
            return lay.gather_layer(blocks, layer, hit_tokens, out=out)

        def send(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            if k.shape[0]:
                miss_blocks = [ctx.pool.slot(slots[i]) for i in range(num_hit, len(slots))]
                lay.scatter_layer(miss_blocks, layer, k, v)
            start, _ = lay.layer_byte_range(layer)
            descs = [
                (ctx.pool.offset(slots[i]) + start, de.slot_offsets[i] + start, lbb) for i in ship
            ]
            ctx.transfer.write(task.de_node, descs)
            ctx.charge([tx], len(descs) * lbb, "pe_to_de")

        # The DE engine's compute NIC carries these bytes too, while they move: its rx the KV
        # written into its buffer, its tx the DE-path hits read out of it. The initiator paces
        # the transfers with its own ports; the DE's ports are held for them from now on.
        ctx.send(task.de_node, RemoteCharge(task.de_engine, "rx", lay.num_layers * len(ship) * lbb))
        if de_side:
            ctx.send(
                task.de_node,
                RemoteCharge(task.de_engine, "tx", lay.num_layers * len(de_side) * lbb),
            )

        state = self.model.begin_prefill(list(task.token_ids), hit_tokens)
        shipped: list[Future[None]] = []
        num_layers = lay.num_layers
        if ctx.cfg.is_layerwise:
            pending = self._fetcher.submit(fetch, 0)
            for layer in range(num_layers):
                k, v = pending.result()
                if layer + 1 < num_layers:
                    pending = self._fetcher.submit(fetch, layer + 1)
                nk, nv = self.model.prefill_layer(state, layer, k, v)
                shipped.append(self._shipper.submit(send, layer, nk, nv))
        else:
            cached = [fetch(layer) for layer in range(num_layers)]
            for layer in range(num_layers):
                nk, nv = self.model.prefill_layer(state, layer, *cached[layer])
                shipped.append(self._shipper.submit(send, layer, nk, nv))
        logits = self.model.finish_prefill(state)
        sampling = SamplingParams(
            max_tokens=task.max_tokens, temperature=task.temperature, seed=task.sample_seed
        )
        first_token = sample_token(logits, sampling, 0)
        for f in shipped:
            f.result()
        ctx.pool.free(slots)
        ctx.send(
            task.de_node,
            PrefillDone(task.request_id, first_token, num_hit, started_at, time.time()),
        )
