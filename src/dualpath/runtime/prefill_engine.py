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

Intra-engine batching (paper §6.2): each forward pass is packed by
`dualpath.sched.pack_prefill_batch` from the FIFO of runnable requests (reads done, DE buffer
ready), under `compute_quota_s` of estimated time (`estimator.py`: by default fitted to this
model's passes timed on this machine at node start-up; or the cost model). A request that does
not fit whole is chunked: the chunk runs now and the rest stays at its place in the queue with
the chunk's tokens counted as cached. The packed
requests run back to back within the pass, layer by layer (the model prefills one sequence at a
time), so per layer every entry's cached KV is fetched while the previous layer computes.

Chunked prefill: chunk j computes tokens `[a, b)` after `a` cached tokens; layer l's KV of the
chunk is written into the request's PE buffer slots (where the hit blocks already are, DE-side
hits included once read over the compute network), so the next chunk gathers tokens `[0, b)`
of each layer from the slots: the earlier chunks' KV is reused, not recomputed. Layerwise
prefill keeps one layer in engine memory, so every chunk reloads its cached KV layer by layer
(charged as H2D on the compute NIC; the first chunk charges the two read paths as above). A
block is shipped to the DE once, by the chunk that completes it (PE-path hits by the first).

Block-state invariant: a hit block is in exactly one of "being read into a buffer", "in the PE
(or DE) buffer", "in PE engine memory" (the gathered layer tensor) at a time; PE buffer slots
are freed only after every layer of the request's last chunk has been written to the DE buffer.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
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
from dualpath.runtime.model.sampling import sample
from dualpath.runtime.node_context import NodeContext, ReadJob
from dualpath.sched.batching import BatchEntry, PrefillItem, pack_prefill_batch
from dualpath.sched.cost import AttentionTimeEstimator


@dataclass
class _PeRequest:
    task: PrefillTask
    read: ReadJob
    de_ready: DeBufferReady | None = None
    num_hit_blocks: int = -1
    """Usable hit blocks, resolved when the request first runs (-1: not yet)."""
    num_pe_hit_blocks: int = 0
    cached_tokens: int = 0
    """Tokens whose KV is in the PE buffer slots: the hit, then every chunk computed."""
    started_at: float = 0.0

    @property
    def is_runnable(self) -> bool:
        return self.read.done.is_set() and self.de_ready is not None

    @property
    def num_tokens(self) -> int:
        return len(self.task.turn.token_ids)

    @property
    def is_started(self) -> bool:
        return self.num_hit_blocks >= 0


class PrefillEngine:
    """One PE (an engine thread of a prefill node)."""

    def __init__(
        self, ctx: NodeContext, engine_id: int, model: Any, estimator: AttentionTimeEstimator
    ) -> None:
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
        self.estimator = estimator

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
            num_slots=self.ctx.layout.num_blocks(len(task.turn.token_ids)),
            blocks=[(i, task.turn.block_keys[i]) for i in range(task.num_pe_blocks)],
            block_size=bs,
            on_done=lambda _job: self._wake(),
        )
        with self._cond:
            self._queue.append(_PeRequest(task, job))
            self._num_tokens += len(task.turn.token_ids)
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
        """Forward passes until stopped: each packs, in FIFO order, the requests whose reads
        are done (a request waiting for its DE buffer never blocks one behind it that is
        ready) under the compute quota."""
        cfg = self.ctx.cfg
        try:
            while True:
                with self._cond:
                    runnable = [r for r in self._queue if r.is_runnable]
                    while not runnable and not self._is_stopping:
                        self._cond.wait(timeout=0.05)
                        runnable = [r for r in self._queue if r.is_runnable]
                    if not runnable:
                        return
                for r in runnable:
                    if not r.is_started:
                        self._resolve_hit(r)
                batch = pack_prefill_batch(
                    [
                        PrefillItem(i, r.cached_tokens, r.num_tokens - r.cached_tokens)
                        for i, r in enumerate(runnable)
                    ],
                    cfg.compute_quota_s,
                    self.estimator,
                    max_batch_tokens=cfg.max_batch_tokens,
                )
                # PrefillItem ids are positions in `runnable` (request ids would do as well).
                floor = min(self.ctx.layout.block_size, cfg.max_batch_tokens or 1 << 62)
                entries = _with_min_chunk(batch.entries, runnable, floor)
                chunks = [_Chunk(self, runnable[e.request_id], e) for e in entries]
                with torch.inference_mode():
                    self._forward(chunks)
                done = [c.req for c in chunks if not c.entry.is_chunk]
                with self._cond:
                    for r in done:
                        self._queue.remove(r)
                        self._num_tokens -= r.num_tokens
        finally:
            self._fetcher.shutdown(wait=False)
            self._shipper.shutdown(wait=False)

    def _resolve_hit(self, req: _PeRequest) -> None:
        """Fix the request's usable hit (its reads are done) and hold the DE engine's compute
        NIC for the bytes the whole request will move through it."""
        ctx, lay, task = self.ctx, self.ctx.layout, req.task
        de = req.de_ready
        assert de is not None
        num_pe = task.num_pe_blocks
        # A missing or corrupt block ends the usable hit: everything after it is recomputed.
        if req.read.num_valid_blocks < num_pe:
            num_hit = req.read.num_valid_blocks
        else:
            num_hit = num_pe + de.num_valid_de_blocks
        req.num_hit_blocks = min(num_hit, task.turn.num_hit_blocks)
        req.num_pe_hit_blocks = min(num_pe, req.num_hit_blocks)
        req.cached_tokens = req.num_hit_blocks * lay.block_size
        req.started_at = time.time()
        num_slots = len(req.read.slots)
        num_shipped = num_slots - (req.num_hit_blocks - req.num_pe_hit_blocks)
        num_de_side = req.num_hit_blocks - req.num_pe_hit_blocks
        lbb = lay.layer_block_bytes
        # The DE engine's compute NIC carries these bytes too, while they move: its rx the KV
        # written into its buffer, its tx the DE-path hits read out of it. The initiator paces
        # the transfers with its own ports; the DE's ports are held for them from now on.
        ctx.send(
            task.de_node, RemoteCharge(task.de_engine, "rx", lay.num_layers * num_shipped * lbb)
        )
        if num_de_side:
            ctx.send(
                task.de_node,
                RemoteCharge(task.de_engine, "tx", lay.num_layers * num_de_side * lbb),
            )

    def _forward(self, chunks: list[_Chunk]) -> None:
        """One forward pass: every chunk layer by layer, back to back within each layer."""
        num_layers = self.ctx.layout.num_layers
        shipped: list[Future[None]] = []

        def fetch_all(layer: int) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
            return [c.fetch(layer) for c in chunks]

        if self.ctx.cfg.is_layerwise:
            pending = self._fetcher.submit(fetch_all, 0)
            for layer in range(num_layers):
                cached = pending.result()
                if layer + 1 < num_layers:
                    pending = self._fetcher.submit(fetch_all, layer + 1)
                for c, (k, v) in zip(chunks, cached, strict=True):
                    nk, nv = self.model.prefill_layer(c.state, layer, k, v)
                    shipped.append(self._shipper.submit(c.send, layer, nk, nv))
        else:
            # Basic: all cached KV is loaded before the pass starts.
            every = [fetch_all(layer) for layer in range(num_layers)]
            for layer in range(num_layers):
                for c, (k, v) in zip(chunks, every[layer], strict=True):
                    nk, nv = self.model.prefill_layer(c.state, layer, k, v)
                    shipped.append(self._shipper.submit(c.send, layer, nk, nv))
        first_tokens = {}
        for c in chunks:
            if not c.entry.is_chunk:
                task = c.req.task
                first_tokens[id(c)] = sample(self.model.finish_prefill(c.state), task.sampling,
                                             task.turn.token_ids, len(task.turn.token_ids),
                                             self.model.config.eos_token_ids)
        # The next chunk of a request gathers this chunk's KV from the slots: wait for it.
        for f in shipped:
            f.result()
        ctx = self.ctx
        ctx.count_engine("num_prefill_passes")
        ctx.count_engine("num_prefill_entries", len(chunks))
        for c in chunks:
            req = c.req
            req.cached_tokens += c.entry.num_new_tokens
            if c.entry.is_chunk:
                ctx.count_engine("num_chunked_entries")
                continue
            ctx.pool.free(req.read.slots)
            ctx.send(
                req.task.de_node,
                PrefillDone(
                    req.task.request_id,
                    first_tokens[id(c)].token_id,
                    first_tokens[id(c)].logprobs,
                    req.num_hit_blocks,
                    req.started_at,
                    time.time(),
                ),
            )


def _with_min_chunk(
    entries: tuple[BatchEntry, ...], runnable: list[_PeRequest], min_tokens: int
) -> tuple[BatchEntry, ...]:
    """Progress floor: a pass whose only entry is a chunk of fewer than `min_tokens` (one
    block, or `max_batch_tokens` if smaller) runs that many instead. The policy gives a lone
    head at least one token when nothing fits; on a CPU whose fitted fixed cost exceeds the
    quota that would be one token a pass."""
    if len(entries) != 1 or not entries[0].is_chunk or entries[0].num_new_tokens >= min_tokens:
        return entries
    e = entries[0]
    r = runnable[e.request_id]
    remaining = r.num_tokens - r.cached_tokens
    n = min(min_tokens, remaining)
    return (BatchEntry(e.request_id, e.cached_tokens, n, n < remaining),)


class _Chunk:
    """One request's share of a forward pass: tokens `[a, b)` after `a` cached ones."""

    def __init__(self, engine: PrefillEngine, req: _PeRequest, entry: BatchEntry) -> None:
        if entry.cached_tokens != req.cached_tokens:
            raise RuntimeError(
                f"PE {engine.engine_id}: request {req.task.request_id} packed with "
                f"{entry.cached_tokens} cached tokens, has {req.cached_tokens}"
            )
        self.engine = engine
        self.req = req
        self.entry = entry
        self.start = entry.cached_tokens
        self.end = entry.cached_tokens + entry.num_new_tokens
        self.is_first = self.start == req.num_hit_blocks * engine.ctx.layout.block_size
        prompt = req.task.turn.token_ids
        self.state = engine.model.begin_prefill(list(prompt[: self.end]), self.start)
        self.ship = self._blocks_to_ship()

    def _blocks_to_ship(self) -> list[int]:
        """PE-path hits (first chunk) and the miss blocks this chunk completes."""
        req, bs = self.req, self.engine.ctx.layout.block_size
        out = list(range(req.num_pe_hit_blocks)) if self.is_first else []
        n = req.num_tokens
        for i in range(req.num_hit_blocks, len(req.read.slots)):
            block_end = min((i + 1) * bs, n)
            if self.start < block_end <= self.end:
                out.append(i)
        return out

    def fetch(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer `layer`'s KV of the cached tokens `[0, start)` into engine memory."""
        eng, req = self.engine, self.req
        ctx, lay, task = eng.ctx, eng.ctx.layout, req.task
        de = req.de_ready
        assert de is not None
        tx, rx = ctx.nics.compute_tx[eng._index], ctx.nics.compute_rx[eng._index]
        slots = req.read.slots
        lbb = lay.layer_block_bytes
        bpl = lay.kv_bytes_per_token_per_layer
        if self.is_first:
            de_side = range(req.num_pe_hit_blocks, req.num_hit_blocks)
            if de_side:
                start, _ = lay.layer_byte_range(layer)
                descs = [
                    (ctx.pool.offset(slots[i]) + start, de.slot_offsets[i] + start, lbb)
                    for i in de_side
                ]
                ctx.transfer.read(task.de_node, descs)
                ctx.charge([rx], len(descs) * lbb, "de_to_pe")
            if req.num_pe_hit_blocks:
                ctx.charge([tx, rx], req.num_pe_hit_blocks * lay.block_size * bpl, "h2d")
        elif self.start:
            # Reload of the hit and earlier chunks from the PE buffer (layerwise prefill keeps
            # no KV in engine memory between passes).
            ctx.charge([tx, rx], self.start * bpl, "h2d")
        if not self.start:
            return None, None
        blocks = [ctx.pool.slot(slots[i]) for i in range(lay.num_blocks(self.start))]
        # Straight from the buffer slots into engine memory (pinned slots on CUDA).
        shape = (self.start, 2, lay.num_kv_heads, lay.head_dim)
        out = torch.empty(shape, dtype=lay.torch_dtype, device=eng.model.device)
        return lay.gather_layer(blocks, layer, self.start, out=out)

    def send(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """This chunk's layer KV into the PE slots, then the completed blocks to the DE."""
        eng, req = self.engine, self.req
        ctx, lay, task = eng.ctx, eng.ctx.layout, req.task
        de = req.de_ready
        assert de is not None
        slots = req.read.slots
        blocks = [ctx.pool.slot(s) for s in slots]
        lay.scatter_layer(blocks, layer, k, v, start_token=self.start)
        lbb = lay.layer_block_bytes
        start, _ = lay.layer_byte_range(layer)
        descs = [
            (ctx.pool.offset(slots[i]) + start, de.slot_offsets[i] + start, lbb)
            for i in self.ship
        ]
        if descs:
            ctx.transfer.write(task.de_node, descs)
            tx = ctx.nics.compute_tx[eng._index]
            ctx.charge([tx], len(descs) * lbb, "pe_to_de")
