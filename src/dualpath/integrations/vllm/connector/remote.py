"""The prefill worker's side of DualPath's P/D flow in vLLM: what moves between a prefill and a
decode instance (the store side is `kvio.KVWorker`, whose counters, event log and load errors
these share).

`PrefillRemote` (prefill worker, vLLM `kv_producer`), per step:
1. `load()` before the forward: for each `RemoteLoad`, the decode instance stages the request's
   DE-side hit blocks from storage into its buffer (side channel `stage`), then one NIXL READ
   per layer is posted, from the staged slots straight into this worker's paged KV pages.
2. `inject(layer)` just before layer `l` runs: waits for layer `l`'s READs only (the layerwise
   pull; the later layers' bytes are still moving while this one computes).
3. `capture(layer)` just after layer `l`'s attention: for each `Push` of the step (the prompt's
   prefill completes in it), one NIXL WRITE of layer `l`'s pages of every block the decode
   instance lacks into slots it allocated (side channel `alloc`), posted at once.
4. `flush()` after the forward: waits for the WRITEs and commits each transfer.

The decode worker's side is `decode_remote.DecodeRemote`; background loads are
`async_loader.AsyncLoader` (the DE part: `staged_pull`). A GPU worker without GPUDirect RDMA
moves its pulls and pushes through pinned host buffers (`bounce`).

Failures never cost a wrong token: a block that did not arrive (stage read error, side channel
down, NIXL error, expired slot) is a load error of the request from that block on, and vLLM
recomputes it (`kv_load_failure_policy="recompute"`); a push that fails leaves the decode
instance without the blocks, which it then recomputes.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Mapping

import torch

from dualpath.integrations.vllm.connector.bounce import Bounce
from dualpath.integrations.vllm.connector.digest import block_digests
from dualpath.integrations.vllm.connector.kvio import KVWorker
from dualpath.integrations.vllm.connector.pages import gather_pages, scatter_pages, wait_for_device
from dualpath.integrations.vllm.connector.peers import DecodePeers, Indices
from dualpath.integrations.vllm.connector.side_channel.wire import (
    SideChannelError,
    Stage,
    Staged,
)
from dualpath.integrations.vllm.connector.staged_pull import STAGE_PIECES, pull_whole
from dualpath.integrations.vllm.connector.step_plan import Push, RemoteLoad, StepPlan
from dualpath.transport.nixl import Pending
from dualpath.transport.traffic_class import KVTrafficClass
from dualpath.transport.transfer_error import TransferError


class PrefillRemote:
    """DE-side pulls and pushes of a prefill worker over NIXL, through its `DecodePeers`
    (descriptors prepared once, named by index).

    `host_bounce`: pulls and pushes go through pinned host buffers (`BouncePool`) instead of
    NIXL moving the paged KV's own pages; None (the default): where the paged KV is on a GPU
    (without GPUDirect RDMA, UCX emulates a transfer between host and VRAM over TCP)."""

    def __init__(self, kv: KVWorker, kv_caches: Mapping[str, torch.Tensor],
                 host_bounce: bool | None = None, stage_pieces: int = STAGE_PIECES,
                 secret: bytes | None = None,
                 traffic_class: KVTrafficClass | None = None) -> None:
        """`stage_pieces`: a background DE-side load is staged and pulled in this many
        pipelined pieces (`stage_chunks`; 1: staged whole, then pulled). `secret`: the
        cluster's side-channel secret, proved to each decode instance's service.
        `traffic_class`: the fabric class of the pulls and pushes."""
        if stage_pieces < 1:
            raise ValueError(f"stage_pieces must be >= 1, got {stage_pieces}")
        self.kv = kv
        self.stage_pieces = stage_pieces
        self.page_bytes = kv.page_bytes
        self.peers = DecodePeers(kv, kv_caches, host_bounce, secret, traffic_class)
        self.host_bounce = self.peers.host_bounce
        self.link = self.peers.link
        self._layer_index = {n: i for i, n in enumerate(kv.layer_names)}
        self._pull_bounce: Bounce | None = None
        """The step's pulls, through the host: their pages, row j for `_pull_ids[j]`."""
        self._pull_ids: list[int] = []
        self._push_bounce: Bounce | None = None
        """The step's pushes, through the host: rows in `_push_slots` order."""
        self._push_ids: list[int] = []
        self._index: dict[str, torch.Tensor] = {}
        """"pull" / "push" -> the step's `_pull_ids` / `_push_ids` as a tensor on the KV's
        device."""
        self._lock = threading.Lock()
        self._plan = StepPlan()
        self._reads: dict[int, list[tuple[str, Pending]]] = defaultdict(list)
        self._writes: list[tuple[Push, Pending]] = []
        self._push_slots: dict[str, list[tuple[int, int]]] = {}
        """req_id -> (block id, slot address) of the step's pushes."""
        self._push_indices: dict[str, list[int]] = {}
        """req_id -> the prompt's block index of each entry of `_push_slots`."""
        self._push_entries: dict[str, Indices] = {}
        """req_id -> the prepared lists' entries of `_push_slots`."""
        self._requested: set[int] = set()
        """Remote loads of this step whose `stage` was sent by `request_stages`."""
        self._fail_from: dict[str, int] = {}
        """req_id -> first DE-side block that failed to load (the decode side lacks it)."""

    def _ids(self, name: str, ids: list[int]) -> torch.Tensor:
        """`ids` as an index tensor on the paged KV's device (once per step and kind)."""
        t = self._index.get(name)
        if t is None:
            t = self._index[name] = torch.tensor(ids, dtype=torch.int64,
                                                 device=self.peers.layers[0].device)
        return t

    def note_failure(self, req_id: str, first_block: int) -> None:
        """Blocks of `req_id` from `first_block` on did not load: vLLM recomputes them, and
        the decode side lacks them (its staged ones included), so the push adds them."""
        with self._lock:
            self._fail_from[req_id] = min(first_block, self._fail_from.get(req_id, first_block))

    def pull_whole(self, r: RemoteLoad) -> int:
        """A background DE-side load, staged and pulled in `stage_pieces` pipelined pieces
        (`staged_pull.pull_whole`); returns the blocks loaded (a prefix)."""
        return pull_whole(self.peers, r, self.stage_pieces)

    def bind(self, plan: StepPlan) -> None:
        self._plan = plan
        self._give_bounces()
        self._reads.clear()
        self._writes = []
        self._push_slots = {}
        self._push_indices = {}
        self._push_entries = {}

    def _give_bounces(self) -> None:
        """The last step's bounce buffers back to the pool (once its READs, waited for by
        `inject`, are over; the copies out of them may still be queued on the GPU)."""
        for reads in self._reads.values():  # a step that did not inject every layer
            for _, pending in reads:
                with contextlib.suppress(TransferError):
                    pending.wait()
        if self.peers.bounces is not None:
            if self._pull_bounce is not None:
                self.peers.bounces.give(self._pull_bounce)
            if self._push_bounce is not None:
                self.peers.bounces.give(self._push_bounce)
        self._pull_bounce = self._push_bounce = None
        self._pull_ids = []
        self._push_ids = []
        self._index = {}

    def request_stages(self) -> None:
        """Ask each decode node to stage the step's DE-side hits, without waiting: its
        storage NIC reads them while this node's reads its own (`KVWorker.load`)."""
        for r in self._plan.remote_loads:
            try:
                client, _ = self.peers.peer(r.de)
                client.send(Stage(*self.peers.stage_args(r)))
                self._requested.add(id(r))
            except (SideChannelError, TransferError, OSError):
                self.peers.drop(r.de)  # load() retries on a new connection

    def load(self) -> None:
        """Stage (if `request_stages` did not) and start pulling every `RemoteLoad` (after the
        store loads of the step): one NIXL READ per layer, waited for by `inject`."""
        requested, self._requested = self._requested, set()
        if self.peers.bounces is not None and self._plan.remote_loads:
            self._pull_bounce = self.peers.bounces.take(
                sum(len(r.blocks.block_ids) for r in self._plan.remote_loads))
        bounce = self._pull_bounce
        for r in self._plan.remote_loads:
            t = r.blocks
            try:
                client, peer = self.peers.peer(r.de)
                if id(r) in requested:
                    reply = client.receive(Staged)
                else:
                    reply = client.stage(*self.peers.stage_args(r))
                if self.kv.has_failed(t.req_id):  # its PE-side part failed: recomputed
                    self.note_failure(t.req_id, t.first_block)
                    continue
                slots = list(reply.slots)
                pairs = list(zip(t.block_ids, slots, strict=False))
                entries = self.peers.entries(r.de, pairs, bounce, len(self._pull_ids))
                if bounce is not None:  # its rows, whatever happens to the READs
                    self._pull_ids += [b for b, _ in pairs]
                for i in range(len(self.peers.layers)):
                    pending = self.peers.post("READ", r.de, peer, entries, slice(i, i + 1),
                                              bounce)
                    if pending is not None:
                        self._reads[i].append((t.req_id, pending))
            except (SideChannelError, TransferError, OSError) as e:
                self.kv.remote_error(t.req_id, "stage", str(e))
                self.peers.drop(r.de)
                slots = []
            ok = len(slots)
            self.kv.count(pulled_blocks=ok)
            if ok < len(t.block_ids):
                self.kv.report_load_error(t.req_id, t.block_ids[ok])
                self.note_failure(t.req_id, t.first_block + ok)
            self.kv.log_event({"event": "pull", "req_id": t.req_id, "de": r.de,
                               "first_block": t.first_block, "blocks": len(t.block_ids),
                               "ok": ok})

    def inject(self, layer_name: str) -> None:
        """Wait for layer `layer_name`'s pulls (before that layer runs); through the host,
        then copy the layer's rows into its paged KV (a failed READ's rows too: those blocks
        are recomputed)."""
        i = self._layer_index[layer_name]
        for req_id, pending in self._reads.pop(i, ()):
            try:
                pending.wait()
            except TransferError as e:
                self.kv.remote_error(req_id, "read", str(e))
                first = next(r for r in self._plan.remote_loads if r.blocks.req_id == req_id)
                self.kv.report_load_error(req_id, first.blocks.block_ids[0])
                self.note_failure(req_id, first.blocks.first_block)
        if self._pull_bounce is not None and self._pull_ids:
            scatter_pages(self.peers.layers[i], self._ids("pull", self._pull_ids),
                          self._pull_bounce.buf[i, :len(self._pull_ids)])
            self._pull_bounce.copied_out(self.peers.layers[i])

    def capture(self, layer_name: str) -> None:
        """Push layer `layer_name`'s pages of the step's pushes (after its attention)."""
        if not self._plan.pushes:
            return
        i = self._layer_index[layer_name]
        if i == 0:
            self._allocate_pushes()
        bounce = self._push_bounce
        if bounce is not None:
            # One gather of the layer's pushed pages into the host buffer: on a GPU after the
            # kernels that write them (same stream), its device-to-host copy waited for.
            gather_pages(self.peers.layers[i], self._ids("push", self._push_ids),
                         bounce.buf[i, :len(self._push_ids)])
        elif self._push_slots:
            # On a GPU, attention was only launched: the WRITE must not read the layer's pages
            # before the kernels that write them are done.
            wait_for_device(self.peers.layers[i])
        for p in self._plan.pushes:
            slots = self._push_slots.get(p.req_id)
            if not slots:
                continue
            try:
                pending = self.peers.post("WRITE", p.de, self.peers.peer(p.de)[1],
                                          self._push_entries[p.req_id], slice(i, i + 1),
                                          bounce)
            except (SideChannelError, TransferError, OSError) as e:
                self._push_failed(p, e)
                continue
            if pending is not None:
                self._writes.append((p, pending))

    def _allocate_pushes(self) -> None:
        """Slots for the step's pushes (side channel `alloc`) and, through the host, the
        bounce rows they are written from (`_push_ids`)."""
        allocated: list[tuple[Push, list[tuple[int, int]]]] = []
        for p in self._plan.pushes:
            if self.kv.has_failed(p.req_id):
                continue  # recomputed in a later step, pushed then
            indices = list(p.block_indices)
            with self._lock:
                fail = self._fail_from.get(p.req_id)
            if fail is not None:  # the decode side lacks its own blocks from there on too
                indices = sorted(set(indices) | set(range(fail, p.hit_blocks)))
            try:
                client, _ = self.peers.peer(p.de)
                addresses = client.alloc(self.kv.shard.xfer(p.xfer), indices)
                slots = [(p.block_ids[b], a) for b, a in zip(indices, addresses, strict=True)]
                self._push_entries[p.req_id] = self.peers.entries(p.de, slots)
            except (SideChannelError, TransferError, OSError) as e:
                self._push_failed(p, e)
                continue
            self._push_slots[p.req_id] = slots
            self._push_indices[p.req_id] = indices
            allocated.append((p, slots))
        num_rows = sum(len(slots) for _, slots in allocated)
        if self.peers.bounces is None or not num_rows:
            return
        bounce = self._push_bounce = self.peers.bounces.take(num_rows)
        for p, slots in allocated:
            self._push_entries[p.req_id] = self.peers.entries(p.de, slots, bounce,
                                                              len(self._push_ids))
            self._push_ids += [block_id for block_id, _ in slots]

    def _push_crcs(self, p: Push) -> dict[int, int]:
        """The digest of each pushed Full Block (`digest.block_digests`: a CRC32C of host
        pages, a word sum computed on the GPU for GPU pages), for the decode worker to check:
        a stale or damaged slot becomes a load error there, never wrong KV."""
        indices = list(self._push_indices.get(p.req_id, ()))
        block_ids = [block_id for block_id, _ in self._push_slots.get(p.req_id, ())]
        return dict(zip(indices, block_digests(self.peers.layers, block_ids), strict=True))

    def _push_failed(self, p: Push, e: Exception) -> None:
        self._push_slots.pop(p.req_id, None)
        self.kv.remote_error(p.req_id, "push", str(e))

    def flush(self) -> None:
        """Wait for the pushes and commit them (after the forward)."""
        failed: set[str] = set()
        for p, pending in self._writes:
            try:
                pending.wait()
            except TransferError as e:
                failed.add(p.req_id)
                self._push_failed(p, e)
        for p in self._plan.pushes:
            slots = self._push_slots.get(p.req_id)
            if not slots or p.req_id in failed or self.kv.has_failed(p.req_id):
                # A pull that failed mid-forward left this step's KV of the request wrong: it
                # is recomputed and pushed again, never committed from this step.
                continue
            try:
                self.peers.peer(p.de)[0].commit(self.kv.shard.xfer(p.xfer), self._push_crcs(p))
            except (SideChannelError, OSError) as e:
                self._push_failed(p, e)
                continue
            self.kv.count(pushed_blocks=len(slots))
            with self._lock:
                self._fail_from.pop(p.req_id, None)
            self.kv.log_event({"event": "push", "req_id": p.req_id, "de": p.de,
                               "blocks": len(slots)})
        self._writes = []

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._give_bounces()
        self.peers.close()
