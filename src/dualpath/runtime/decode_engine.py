"""Decode engine (DE): assembles a request's prompt KV in the DE buffer, decodes, persists.

Per request (paper Fig. 4 and §4 "decode phase"):

1. On its `DecodeTask` the node reader allocates one DE-buffer slot per prompt block (slot i
   holds block i) and reads the DE-path hit blocks `[num_pe_blocks, num_hit_blocks)` from
   storage through the node's storage NIC (DE path steps 1-2); then the PE is told where the
   slots are (`DeBufferReady`). The PE fills every other block layer by layer.
2. On `PrefillDone` the whole prompt KV is in the buffer: the DE reserves engine memory, copies
   it in through its compute NIC (H2D, PE path steps 8-9 / DE path 6-7) and releases the
   buffer, except the prompt's newly computed Full Blocks, which the node writer persists
   first (their slots are freed once stored).
3. It decodes in a batch with its other sequences; every time a sequence completes a Full
   Block, the block is copied out of engine memory (D2H through the compute NIC) into a buffer
   slot and persisted. `TurnDone` is sent once the request's blocks are all stored, so the
   agent's next turn finds them. A streaming request also gets each step's new tokens at once
   (`TurnTokens`); a request that does not ignore EOS ends at its first EOS token, and a
   cancelled one (`Cancel`) at its next decode step.

Block-state invariant: each block of the request is in exactly one of "in the DE buffer",
"in DE engine memory" (+ "being persisted" from a buffer slot) at a time; a slot is freed only
after its block is in engine memory or in storage.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from dualpath.core.blocks import ROOT_KEY, block_key
from dualpath.runtime.messages import (
    Cancel,
    DeBufferReady,
    DecodeTask,
    EngineLoad,
    Message,
    PrefillDone,
    TurnDone,
    TurnTokens,
)
from dualpath.runtime.model.kv_cache import DecodeSequence, KVCache
from dualpath.runtime.node_context import NodeContext, ReadJob
from dualpath.transport.transfer_error import BufferFullError


@dataclass
class _DeRequest:
    task: DecodeTask
    read: ReadJob
    keys: list[bytes] = field(default_factory=list)
    """Keys of the sequence's full blocks so far (prompt blocks, then generated ones)."""
    seq: DecodeSequence | None = None
    num_persisted_blocks: int = 0
    first_token_at: float = 0.0
    num_streamed: int = 0
    """Generated tokens already reported (`TurnTokens`, streaming requests only)."""
    is_cancelled: bool = False
    """The driver cancelled it: it ends at its next decode step (or right after admission)."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.task.turn.token_ids)

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.task.sampling.max_tokens


class DecodeEngine:
    """One DE (an engine thread of a decode node) with its paged KV cache."""

    def __init__(self, ctx: NodeContext, engine_id: int, model: Any) -> None:
        self.ctx = ctx
        self.engine_id = engine_id
        self.model = model
        self._index = ctx.engine_index(engine_id)
        lay = ctx.layout
        # One page = one block of tokens over all layers = one Full Block.
        page_bytes = lay.full_block_bytes
        self.cache = KVCache(
            model.config,
            num_pages=max(1, ctx.cfg.hbm_bytes // page_bytes),
            page_tokens=lay.block_size,
            device=model.device,
            dtype=lay.torch_dtype,
        )
        self._cond = threading.Condition()
        self._requests: dict[int, _DeRequest] = {}
        self._ready: deque[tuple[_DeRequest, PrefillDone]] = deque()
        self._active: list[_DeRequest] = []
        self._is_stopping = False

    # -- node loop side --------------------------------------------------------------------
    def on_message(self, msg: Message) -> None:
        if isinstance(msg, DecodeTask):
            self._accept(msg)
        elif isinstance(msg, PrefillDone):
            with self._cond:
                self._ready.append((self._requests[msg.request_id], msg))
                self._cond.notify_all()
        elif isinstance(msg, Cancel):
            with self._cond:
                req = self._requests.get(msg.request_id)
                if req is not None:  # else it has finished already
                    req.is_cancelled = True
        else:
            raise RuntimeError(f"DE {self.engine_id}: unexpected message {msg!r}")

    def _accept(self, task: DecodeTask) -> None:
        bs = self.ctx.layout.block_size
        job = ReadJob(
            request_id=task.request_id,
            num_slots=self.ctx.layout.num_blocks(len(task.turn.token_ids)),
            blocks=[(i, task.turn.block_keys[i])
                    for i in range(task.num_pe_blocks, task.turn.num_hit_blocks)],
            block_size=bs,
            on_done=self._buffer_ready,
        )
        req = _DeRequest(task, job, keys=list(task.turn.block_keys))
        with self._cond:
            self._requests[task.request_id] = req
        self.ctx.add_read_q((task.turn.num_hit_blocks - task.num_pe_blocks) * bs)
        self.ctx.read_queue.put(job)

    def _buffer_ready(self, job: ReadJob) -> None:
        """Reader thread: the DE buffer is allocated and the DE-side hits are loaded."""
        task = self._requests[job.request_id].task
        self.ctx.send(
            task.pe_node,
            DeBufferReady(
                request_id=job.request_id,
                slots=tuple(job.slots),
                slot_offsets=tuple(self.ctx.pool.offset(s) for s in job.slots),
                num_valid_de_blocks=job.num_valid_blocks,
            ),
        )

    def load(self) -> EngineLoad:
        with self._cond:
            reqs = list(self._requests.values())
            # Memory promised to requests not admitted yet counts as used.
            pending_tokens = sum(r.max_total_tokens for r in reqs if r.seq is None)
            page_bytes = self.cache.bytes_per_page
            free_bytes = self.cache.num_free_pages * page_bytes
            active_growth = sum(
                r.max_total_tokens - len(r.seq.pages) * self.cache.page_tokens
                for r in reqs
                if r.seq is not None
            )
            bpt = self.ctx.layout.kv_bytes_per_token
            return EngineLoad(
                engine_id=self.engine_id,
                num_seqs=len(reqs),
                num_tokens=sum(r.num_prompt_tokens for r in reqs),
                read_q_tokens=self.ctx.read_q_tokens,
                free_hbm_bytes=max(0, free_bytes - (pending_tokens + max(0, active_growth)) * bpt),
            )

    def stop(self) -> None:
        with self._cond:
            self._is_stopping = True
            self._cond.notify_all()

    # -- engine thread ---------------------------------------------------------------------
    def run(self) -> None:
        """Admit ready requests, run decode steps over the active batch, persist blocks."""
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not self._ready and not self._active and not self._is_stopping:
                        self._cond.wait(timeout=0.05)
                    if self._is_stopping:
                        return
                    ready = list(self._ready)
                    self._ready.clear()
                for k, (req, done) in enumerate(ready):
                    if self.cache.pages_for(req.num_prompt_tokens) > self.cache.num_free_pages:
                        # Not enough engine memory yet: wait for running sequences to finish.
                        with self._cond:
                            self._ready.extendleft(reversed(ready[k:]))
                        break
                    self._admit(req, done)
                if self._active:
                    self._step()

    def _admit(self, req: _DeRequest, done: PrefillDone) -> None:
        ctx, lay, task = self.ctx, self.ctx.layout, req.task
        n = req.num_prompt_tokens
        seq = DecodeSequence(task.request_id, list(task.turn.token_ids), n, task.sampling)
        seq.append(done.first_token, self.model.config.eos_token_ids, done.first_logprobs)
        slots = req.read.slots
        blocks = [ctx.pool.slot(s) for s in slots]
        self.cache.load_blocks(seq, lay, blocks, n)
        ctx.charge(self._cnic(), n * lay.kv_bytes_per_token, "h2d")
        # Prompt blocks computed by this request's prefill are persisted from the buffer;
        # the hit blocks are already stored and their slots go back now.
        num_full = n // lay.block_size
        persist = range(min(done.num_hit_blocks, num_full), num_full)
        for i in persist:
            ctx.write_queue.put((req.keys[i], slots[i]))
        ctx.pool.free([s for i, s in enumerate(slots) if i not in persist])
        req.num_persisted_blocks = num_full
        req.first_token_at = time.time()
        with self._cond:
            req.seq = seq
            self._active.append(req)
        self._stream(req)
        if req.is_cancelled and not seq.is_finished:
            seq.finish_reason = "cancelled"
        if seq.is_finished:
            self._finish(req)

    def _cnic(self) -> list[Any]:
        return [self.ctx.nics.compute_tx[self._index], self.ctx.nics.compute_rx[self._index]]

    def _step(self) -> None:
        for req in [r for r in self._active if r.is_cancelled]:
            # Its completed blocks were persisted after its last step.
            assert req.seq is not None
            req.seq.finish_reason = "cancelled"
            self._finish(req)
        seqs = [r.seq for r in self._active if r.seq is not None]
        if not seqs:
            return
        self.model.decode_step(seqs, self.cache)
        for req in list(self._active):
            self._persist_completed(req)
            self._stream(req)
            assert req.seq is not None
            if req.seq.is_finished:
                self._finish(req)

    def _stream(self, req: _DeRequest) -> None:
        """A streaming request's tokens since its last report, sent on at once (its
        `TurnDone` waits for persistence; these do not)."""
        seq = req.seq
        if not req.task.is_streaming or seq is None:
            return
        out = seq.output_ids
        if len(out) > req.num_streamed:
            self.ctx.send(None, TurnTokens(req.task.request_id, tuple(out[req.num_streamed:]),
                                           tuple(seq.logprobs[req.num_streamed:])))
            req.num_streamed = len(out)

    def _persist_completed(self, req: _DeRequest) -> None:
        """Copy every newly completed Full Block out of engine memory and queue its write."""
        ctx, lay, seq = self.ctx, self.ctx.layout, req.seq
        assert seq is not None
        bs = lay.block_size
        while (req.num_persisted_blocks + 1) * bs <= seq.num_kv_tokens:
            b = req.num_persisted_blocks
            tokens = seq.token_ids[b * bs : (b + 1) * bs]
            parent = req.keys[b - 1] if b else ROOT_KEY
            if b >= len(req.keys):
                req.keys.append(block_key(parent, tokens))
            try:
                (slot,) = ctx.pool.alloc(1, timeout_s=0.0)
            except BufferFullError:
                # The buffer is full of prompts that wait for this very thread to admit them:
                # waiting here would deadlock. The block stays in engine memory and is tried
                # again after the next step (and once more when the request finishes).
                ctx.count_engine("num_persist_deferred")
                return
            self.cache.export_block(seq, lay, b, ctx.pool.slot(slot))
            ctx.charge(self._cnic(), lay.full_block_bytes, "d2h")
            ctx.write_queue.put((req.keys[b], slot))
            req.num_persisted_blocks += 1

    def _finish(self, req: _DeRequest) -> None:
        seq = req.seq
        assert seq is not None
        self._persist_completed(req)
        skipped = seq.num_kv_tokens // self.ctx.layout.block_size - req.num_persisted_blocks
        if skipped > 0:  # still no free slot: those blocks are not cached (a later miss)
            self.ctx.count_engine("num_persist_skipped_blocks", skipped)
        self.cache.release(seq)
        with self._cond:
            self._active.remove(req)
        done = TurnDone(
            request_id=req.task.request_id,
            output_ids=tuple(seq.output_ids),
            first_token_at=req.first_token_at,
            done_at=0.0,
            logprobs=tuple(seq.logprobs),
        )

        def report() -> None:
            with self._cond:
                self._requests.pop(req.task.request_id, None)
            self.ctx.send(None, replace(done, done_at=time.time()))

        # Sent after this request's blocks are stored, so the next turn of the agent hits.
        self.ctx.write_queue.put(report)
