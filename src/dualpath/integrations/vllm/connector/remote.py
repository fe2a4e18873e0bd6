"""The worker side of DualPath's P/D flow in vLLM: what moves between a prefill and a decode
instance (the store side is `kvio.KVWorker`, whose counters, event log and load errors these
share).

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

`DecodeRemote` (decode worker, vLLM `kv_consumer`): `load()` looks a request's blocks up in the
staging buffer (staged or committed, under the request's `xfer`), `inject(layer)` copies layer
`l`'s pages into the paged KV, `flush()` frees the request's slots.

Without GPUDirect RDMA (no RDMA NIC, or no GDR), UCX has no transport that moves host memory
into or out of VRAM: it emulates such a READ or WRITE over TCP (0.63-0.68 GB/s on an H200 node,
against 2.2-3.2 GB/s host to host there). So a GPU worker bounces by default (`host_bounce`):
its pulls READ into a registered pinned host buffer, layer-major, and `inject(layer)` copies
the layer's rows into the paged KV (one host-to-device copy, one `index_copy_`:
`kvio.scatter_pages`); its pushes gather each layer's pages into such a buffer (one
`index_select`, one device-to-host copy: `kvio.gather_pages`) and WRITE from there. The
direct path (NIXL straight into and out of VRAM) is for GPUDirect nodes.

Failures never cost a wrong token: a block that did not arrive (stage read error, side channel
down, NIXL error, expired slot) is a load error of the request from that block on, and vLLM
recomputes it (`kv_load_failure_policy="recompute"`); a push that fails leaves the decode
instance without the blocks, which it then recomputes.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from dualpath.integrations.vllm.connector.digest import block_digests, matches
from dualpath.integrations.vllm.connector.kvio import (
    FitPool,
    KVWorker,
    gather_pages,
    paged_kv_bases,
    scatter_pages,
    wait_for_device,
)
from dualpath.integrations.vllm.connector.plan import (
    BACKGROUND_LOAD_THREADS,
    BlockTransfer,
    Push,
    RemoteLoad,
    StepPlan,
)
from dualpath.integrations.vllm.connector.side_channel.client import SideChannelClient
from dualpath.integrations.vllm.connector.side_channel.staging import StagingPool
from dualpath.integrations.vllm.connector.side_channel.wire import (
    SideChannelError,
    Stage,
    Staged,
)
from dualpath.transport.nixl import NixlAgent, Pending, Prepped, agent_name
from dualpath.transport.transfer_error import TransferError

Indices = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]
"""Per layer (rows), the entries of a batch in the local and the remote prepared list."""

STAGE_PIECES = 4
"""A background DE-side load is staged in this many pieces (`stage_chunks`), so that the decode
instance's store reads of one piece overlap this worker's pull of the one before."""

MIN_STAGE_PIECE_BLOCKS = 8
"""...of at least this many blocks each (a piece's store reads run in parallel)."""


def stage_chunks(num_blocks: int, pieces: int = STAGE_PIECES, first_block: int = 0,
                 blocks_per_file: int = 1) -> list[tuple[int, int]]:
    """The [lo, hi) ranges (relative to `first_block`) a background load of `num_blocks` is
    staged and pulled in: at most `pieces`, each of at least `MIN_STAGE_PIECE_BLOCKS` and
    ending on a file's edge (files of `blocks_per_file` blocks, so no file is read twice),
    the last one where the load ends."""
    g = blocks_per_file
    size = max(MIN_STAGE_PIECE_BLOCKS, -(-num_blocks // pieces))
    bounds = [0]
    while bounds[-1] < num_blocks:
        end = first_block + bounds[-1] + size
        bounds.append(min(num_blocks, -(-end // g) * g - first_block))
    return list(itertools.pairwise(bounds))


BOUNCE_CHUNK_BYTES = 1 << 29
"""A background pull through the host (`PrefillRemote.pull_whole`) bounces at most this many
bytes at a time (a request's whole hit would pin as much host memory as it has KV)."""


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
    """`Bounce` buffers taken whole and given back (`kvio.FitPool`): each is registered with
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


class PrefillRemote:
    """DE-side pulls and pushes of a prefill worker over NIXL. Its descriptors are prepared
    once: every page of the paged KV (at registration: about 0.2 s per million pages, not in
    a forward) or, through the host (`host_bounce`), every page of each bounce buffer (when
    it is made), and every page of each decode node's staging slots (at first contact); a
    pull or push names entries of them by index.

    `host_bounce`: pulls and pushes go through pinned host buffers (`BouncePool`) instead of
    NIXL moving the paged KV's own pages; None (the default): where the paged KV is on a GPU
    (without GPUDirect RDMA, UCX emulates a transfer between host and VRAM over TCP)."""

    def __init__(self, kv: KVWorker, kv_caches: Mapping[str, torch.Tensor],
                 host_bounce: bool | None = None, stage_pieces: int = STAGE_PIECES,
                 secret: bytes | None = None) -> None:
        """`stage_pieces`: a background DE-side load is staged and pulled in this many
        pipelined pieces (`stage_chunks`; 1: staged whole, then pulled). `secret`: the
        cluster's side-channel secret, proved to each decode instance's service."""
        self.secret = secret
        if stage_pieces < 1:
            raise ValueError(f"stage_pieces must be >= 1, got {stage_pieces}")
        self.kv = kv
        self.stage_pieces = stage_pieces
        self.page_bytes = kv.page_bytes
        self._bases = paged_kv_bases(kv_caches, kv.layer_names, kv.page_bytes)
        self._layers = [kv_caches[name] for name in kv.layer_names]
        self._layer_index = {n: i for i, n in enumerate(kv.layer_names)}
        counts = np.array([kv_caches[n].shape[0] for n in kv.layer_names], dtype=np.int64)
        self._first_entry = np.concatenate(([0], np.cumsum(counts)[:-1]))
        """Layer -> the local list's entry of its block 0 (entry of block b: that + b)."""
        self._num_blocks = counts
        self._remotes: dict[str, tuple[Prepped, int]] = {}
        """decode side channel -> its staging slots' prepared list and the buffer's address."""
        is_cuda = any(layer.is_cuda for layer in self._layers)
        self.host_bounce = is_cuda if host_bounce is None else host_bounce
        self.link = NixlAgent(agent_name("prefill"))
        self._local: Prepped | None = None
        """Direct: every layer's page of every block of the paged KV (entry of layer l, block
        b: `_first_entry[l] + b`)."""
        self._bounces: BouncePool | None = None
        if self.host_bounce:
            self._bounces = BouncePool(self.link, len(self._bases), self.page_bytes,
                                       pinned=is_cuda)
        else:
            self.link.register_tensors(b.span for b in self._bases)
            self._local = self.link.prep(np.concatenate([
                np.uint64(b.address) + np.arange(count, dtype=np.uint64)
                * np.uint64(b.block_stride_bytes)
                for b, count in zip(self._bases, counts, strict=True)]), self.page_bytes)
        self._pull_bounce: Bounce | None = None
        """The step's pulls, through the host: their pages, row j for `_pull_ids[j]`."""
        self._pull_ids: list[int] = []
        self._push_bounce: Bounce | None = None
        """The step's pushes, through the host: rows in `_push_slots` order."""
        self._push_ids: list[int] = []
        self._index: dict[str, torch.Tensor] = {}
        """"pull" / "push" -> the step's `_pull_ids` / `_push_ids` as a tensor on the KV's
        device."""
        self._peers: dict[tuple[str, int], SideChannelClient] = {}
        """(decode side channel, thread) -> a connection (a background load's long `stage`
        never holds up the engine thread's pushes)."""
        self._agents: dict[str, str] = {}
        """decode side channel -> its NIXL agent name (again when a new connection finds a
        new one: a restarted decode instance)."""
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

    def _peer(self, address: str) -> tuple[SideChannelClient, str]:
        slot = (address, threading.get_ident())
        with self._lock:
            client = self._peers.get(slot)
            agent = self._agents.get(address)
        if client is not None and agent is not None:
            return client, agent
        client = SideChannelClient(self.kv.shard.side_channel(address),  # this rank's
                                   secret=self.secret)
        # This worker's agent is not sent: the decode side is only ever the target of
        # one-sided READs and WRITEs, and its connecting back while this worker (no progress
        # thread) was in a forward hung loadRemoteMD here for good over TCP (emulated hosts).
        info = client.hello(b"")
        if info.full_block_bytes != self.kv.full_block_bytes:
            client.close()
            raise SideChannelError(f"decode instance {address} holds "
                                   f"{info.full_block_bytes} B blocks, this prefill "
                                   f"{self.kv.full_block_bytes} B: not the same model")
        with self._lock:
            try:
                # A new connection may find a new agent: the decode instance was restarted
                # (its staging service is a new process). Transfers prepared for the old
                # one fail (`_post`) and their requests recompute; new ones use this.
                agent = self.link.connect(info.agent)
                if self._agents.get(address) != agent or address not in self._remotes:
                    self._agents[address] = agent
                    self._remotes[address] = (self._prep_slots(agent, info.address,
                                                               info.num_slots), info.address)
            except TransferError:
                client.close()
                raise
            self._peers[slot] = client
            return client, self._agents[address]

    def _prep_slots(self, agent: str, address: int, num_slots: int) -> Prepped:
        """Every layer's page of every staging slot of the decode node `agent` (entry of slot
        s, layer l: s * layers + l)."""
        n, layers = self.page_bytes, len(self._bases)
        slots = np.arange(num_slots, dtype=np.uint64)[:, None] * np.uint64(layers * n)
        pages = np.arange(layers, dtype=np.uint64)[None, :] * np.uint64(n)
        return self.link.prep((np.uint64(address) + slots + pages).ravel(), n, peer=agent)

    def _entries(self, de: str, pairs: Sequence[tuple[int, int]],
                 bounce: Bounce | None = None, first_row: int = 0) -> Indices:
        """Per layer, the entries of each (vLLM block id, staging slot address) pair's page
        in the local list (the paged KV's, or `bounce`'s rows from `first_row` on) and in
        `de`'s."""
        with self._lock:
            _, base = self._remotes[de]
        block_ids = np.fromiter((b for b, _ in pairs), dtype=np.int64, count=len(pairs))
        offsets = np.fromiter((a for _, a in pairs), dtype=np.int64, count=len(pairs)) - base
        slots, misaligned = np.divmod(offsets, self.kv.full_block_bytes)
        if misaligned.any() or (block_ids >= self._num_blocks.min()).any():
            raise TransferError(f"slot addresses or block ids outside {de}'s staging buffer "
                                "or this worker's paged KV")
        layers = np.arange(len(self._bases), dtype=np.int64)[:, None]
        local = bounce.entries(first_row, len(pairs)) if bounce is not None \
            else self._first_entry[:, None] + block_ids
        return local, slots * len(self._bases) + layers

    def _post(self, op: str, de: str, peer: str, entries: Indices, layers: slice,
              bounce: Bounce | None = None) -> Pending | None:
        """Start `op` of `entries`' pages of `layers` with the decode node `de` (agent
        `peer`), `bounce`'s rows or the paged KV's pages here."""
        local, remote = entries
        with self._lock:
            slots_list, _ = self._remotes[de]
        if slots_list.peer != peer:
            raise TransferError(f"decode node {de}: its NIXL agent changed")
        local_list = bounce.prepped if bounce is not None else self._local
        assert local_list is not None
        return self.link.post_prepped(op, local_list, local[layers].ravel(),
                                      slots_list, remote[layers].ravel())

    def _ids(self, name: str, ids: list[int]) -> torch.Tensor:
        """`ids` as an index tensor on the paged KV's device (once per step and kind)."""
        t = self._index.get(name)
        if t is None:
            t = self._index[name] = torch.tensor(ids, dtype=torch.int64,
                                                 device=self._layers[0].device)
        return t

    def _stage_args(self, r: RemoteLoad) -> tuple[str, int, tuple[bytes, ...], int]:
        """A `stage` of `r` in this rank's names: its transfer, its shard's keys of the files
        holding its blocks (the decode rank of the same index reads this rank's files) and
        how many blocks."""
        shard = self.kv.shard
        return (shard.xfer(r.xfer), r.blocks.first_block, tuple(map(shard.key, r.blocks.keys)),
                len(r.blocks.block_ids))

    def _drop_peer(self, address: str) -> None:
        with self._lock:
            client = self._peers.pop((address, threading.get_ident()), None)
        if client is not None:
            client.close()

    def note_failure(self, req_id: str, first_block: int) -> None:
        """Blocks of `req_id` from `first_block` on did not load: vLLM recomputes them, and
        the decode side lacks them (its staged ones included), so the push adds them."""
        with self._lock:
            self._fail_from[req_id] = min(first_block, self._fail_from.get(req_id, first_block))

    def pull_whole(self, r: RemoteLoad) -> int:
        """A background DE-side load: staged and pulled in `stage_chunks` pieces, pipelined:
        every piece's `stage` is sent at once, so the decode instance reads piece k+1 from its
        store while this worker pulls piece k (one NIXL READ of every layer's page of the
        piece's blocks into the paged KV, through the host when bouncing), waited for; returns
        the blocks loaded (a prefix)."""
        t = r.blocks
        ok = 0
        try:
            client, peer = self._peer(r.de)
            xfer, first, keys, _ = self._stage_args(r)
            g = t.blocks_per_file
            pieces = stage_chunks(len(t.block_ids), self.stage_pieces, first, g)
            for lo, hi in pieces:  # a piece's files: those holding its blocks
                k0 = (first + lo) // g - first // g
                k1 = (first + hi - 1) // g - first // g + 1
                client.send(Stage(xfer, first + lo, keys[k0:k1], hi - lo))
            replies = 0
            try:
                for lo, hi in pieces:
                    slots = client.receive(Staged).slots
                    replies += 1
                    pairs = list(zip(t.block_ids[lo:hi], slots, strict=False))
                    ok += self._pull_pairs(r.de, peer, pairs)
                    if len(slots) < hi - lo:
                        break  # a stage read failed: the rest is recomputed
            finally:  # the later pieces' replies: none may still be reading into a slot
                for _ in range(len(pieces) - replies):
                    client.receive(Staged)
        except _Partial as e:
            ok += e.ok
            self.kv.remote_error(t.req_id, "pull", str(e.error), thread=threading.get_ident())
            self._drop_peer(r.de)
        except (SideChannelError, TransferError, OSError) as e:
            self.kv.remote_error(t.req_id, "pull", str(e), thread=threading.get_ident())
            self._drop_peer(r.de)
        self.kv.count(pulled_blocks=ok)
        self.kv.log_event({"event": "pull", "req_id": t.req_id, "de": r.de, "background": True,
                           "first_block": t.first_block, "blocks": len(t.block_ids), "ok": ok})
        return ok

    def _pull_pairs(self, de: str, peer: str, pairs: list[tuple[int, int]]) -> int:
        """`pull_whole`'s READ of one staged piece, waited for; returns its blocks (a failure
        raises, `_Partial` with the piece's blocks loaded before it)."""
        if self._bounces is not None:
            return self._pull_whole_bounced(de, peer, pairs)
        pending = self._post("READ", de, peer, self._entries(de, pairs), slice(None))
        if pending is not None:
            pending.wait()
        return len(pairs)

    def _pull_whole_bounced(self, de: str, peer: str, pairs: list[tuple[int, int]]) -> int:
        """`pull_whole`'s READ through a bounce buffer, `BOUNCE_CHUNK_BYTES` at a time, each
        chunk's rows then copied into the paged KV (on a stream of its own on a GPU); returns
        the blocks loaded, or raises `_Partial` with those loaded before a failure."""
        assert self._bounces is not None
        if not pairs:
            return 0
        chunk = max(1, BOUNCE_CHUNK_BYTES // self.kv.full_block_bytes)
        bounce = self._bounces.take(min(len(pairs), chunk))
        first = self._layers[0]
        stream = torch.cuda.Stream(first.device) if first.is_cuda else None  # type: ignore[no-untyped-call]
        ok = 0
        try:
            for start in range(0, len(pairs), chunk):
                part = pairs[start:start + chunk]
                pending = self._post("READ", de, peer, self._entries(de, part, bounce),
                                     slice(None), bounce)
                if pending is not None:
                    pending.wait()
                with torch.cuda.stream(stream) if stream is not None \
                        else contextlib.nullcontext():
                    ids = torch.tensor([b for b, _ in part], dtype=torch.int64,
                                       device=first.device)  # on that stream
                    for i, layer in enumerate(self._layers):
                        scatter_pages(layer, ids, bounce.buf[i, :len(part)])
                if stream is not None:
                    stream.synchronize()
                ok += len(part)
        except (SideChannelError, TransferError, OSError) as e:
            if not ok:
                raise
            raise _Partial(ok, e) from None
        finally:
            self._bounces.give(bounce)
        return ok

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
        if self._bounces is not None:
            if self._pull_bounce is not None:
                self._bounces.give(self._pull_bounce)
            if self._push_bounce is not None:
                self._bounces.give(self._push_bounce)
        self._pull_bounce = self._push_bounce = None
        self._pull_ids = []
        self._push_ids = []
        self._index = {}

    def request_stages(self) -> None:
        """Ask each decode node to stage the step's DE-side hits, without waiting: its
        storage NIC reads them while this node's reads its own (`KVWorker.load`)."""
        for r in self._plan.remote_loads:
            try:
                client, _ = self._peer(r.de)
                client.send(Stage(*self._stage_args(r)))
                self._requested.add(id(r))
            except (SideChannelError, TransferError, OSError):
                self._drop_peer(r.de)  # load() retries on a new connection

    def load(self) -> None:
        """Stage (if `request_stages` did not) and start pulling every `RemoteLoad` (after the
        store loads of the step): one NIXL READ per layer, waited for by `inject`."""
        requested, self._requested = self._requested, set()
        if self._bounces is not None and self._plan.remote_loads:
            self._pull_bounce = self._bounces.take(
                sum(len(r.blocks.block_ids) for r in self._plan.remote_loads))
        bounce = self._pull_bounce
        for r in self._plan.remote_loads:
            t = r.blocks
            try:
                client, peer = self._peer(r.de)
                if id(r) in requested:
                    reply = client.receive(Staged)
                else:
                    reply = client.stage(*self._stage_args(r))
                if self.kv.has_failed(t.req_id):  # its PE-side part failed: recomputed
                    self.note_failure(t.req_id, t.first_block)
                    continue
                slots = list(reply.slots)
                pairs = list(zip(t.block_ids, slots, strict=False))
                entries = self._entries(r.de, pairs, bounce, len(self._pull_ids))
                if bounce is not None:  # its rows, whatever happens to the READs
                    self._pull_ids += [b for b, _ in pairs]
                for i in range(len(self._bases)):
                    pending = self._post("READ", r.de, peer, entries, slice(i, i + 1),
                                         bounce)
                    if pending is not None:
                        self._reads[i].append((t.req_id, pending))
            except (SideChannelError, TransferError, OSError) as e:
                self.kv.remote_error(t.req_id, "stage", str(e))
                self._drop_peer(r.de)
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
            scatter_pages(self._layers[i], self._ids("pull", self._pull_ids),
                          self._pull_bounce.buf[i, :len(self._pull_ids)])
            self._pull_bounce.copied_out(self._layers[i])

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
            gather_pages(self._layers[i], self._ids("push", self._push_ids),
                         bounce.buf[i, :len(self._push_ids)])
        elif self._push_slots:
            # On a GPU, attention was only launched: the WRITE must not read the layer's pages
            # before the kernels that write them are done.
            wait_for_device(self._layers[i])
        for p in self._plan.pushes:
            slots = self._push_slots.get(p.req_id)
            if not slots:
                continue
            try:
                pending = self._post("WRITE", p.de, self._peer(p.de)[1],
                                     self._push_entries[p.req_id], slice(i, i + 1), bounce)
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
                client, _ = self._peer(p.de)
                addresses = client.alloc(self.kv.shard.xfer(p.xfer), indices)
                slots = [(p.block_ids[b], a) for b, a in zip(indices, addresses, strict=True)]
                self._push_entries[p.req_id] = self._entries(p.de, slots)
            except (SideChannelError, TransferError, OSError) as e:
                self._push_failed(p, e)
                continue
            self._push_slots[p.req_id] = slots
            self._push_indices[p.req_id] = indices
            allocated.append((p, slots))
        num_rows = sum(len(slots) for _, slots in allocated)
        if self._bounces is None or not num_rows:
            return
        bounce = self._push_bounce = self._bounces.take(num_rows)
        for p, slots in allocated:
            self._push_entries[p.req_id] = self._entries(p.de, slots, bounce,
                                                         len(self._push_ids))
            self._push_ids += [block_id for block_id, _ in slots]

    def _push_crcs(self, p: Push) -> dict[int, int]:
        """The digest of each pushed Full Block (`digest.block_digests`: a CRC32C of host
        pages, a word sum computed on the GPU for GPU pages), for the decode worker to check:
        a stale or damaged slot becomes a load error there, never wrong KV."""
        indices = list(self._push_indices.get(p.req_id, ()))
        block_ids = [block_id for block_id, _ in self._push_slots.get(p.req_id, ())]
        return dict(zip(indices, block_digests(self._layers, block_ids), strict=True))

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
                self._peer(p.de)[0].commit(self.kv.shard.xfer(p.xfer), self._push_crcs(p))
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
        with self._lock:
            clients = list(self._peers.values())
            self._peers.clear()
        for client in clients:
            client.close()
        with contextlib.suppress(Exception):
            self._give_bounces()
            if self._bounces is not None:
                self._bounces.close()
        with contextlib.suppress(Exception):
            self.link.close()


class _Partial(Exception):
    """A background pull that loaded its first `ok` blocks, then failed with `error`."""

    def __init__(self, ok: int, error: Exception) -> None:
        super().__init__(str(error))
        self.ok = ok
        self.error = error


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
