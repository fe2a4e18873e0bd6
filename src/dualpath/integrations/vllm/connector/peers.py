"""The two ends of a prefill worker's NIXL transfers with the decode nodes (`DecodePeers`).

Its descriptors are prepared once: every page of the paged KV (at registration, not in a
forward) or, through the host (`host_bounce`), every page of each bounce buffer (when it
is made), and every page of each decode node's staging slots (at first contact); a pull or
push names entries of them by index (`entries`, `post`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt
import torch

from dualpath.integrations.vllm.connector.bounce import Bounce, BouncePool
from dualpath.integrations.vllm.connector.kvio import KVWorker
from dualpath.integrations.vllm.connector.pages import paged_kv_bases
from dualpath.integrations.vllm.connector.side_channel.client import SideChannelClient
from dualpath.integrations.vllm.connector.side_channel.wire import SideChannelError
from dualpath.integrations.vllm.connector.step_plan import RemoteLoad
from dualpath.transport.nixl import NixlAgent, Pending, Prepped, agent_name
from dualpath.transport.traffic_class import KVTrafficClass
from dualpath.transport.transfer_error import TransferError

Indices = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]
"""Per layer (rows), the entries of a batch in the local and the remote prepared list."""


class DecodePeers:
    """The decode nodes as a prefill worker's transfers reach them (per node: a side-channel
    connection per thread, its NIXL agent, its staging slots' prepared list), and this
    worker's own end of each transfer (the paged KV's prepared list, or its bounce buffers)."""

    def __init__(self, kv: KVWorker, kv_caches: Mapping[str, torch.Tensor],
                 host_bounce: bool | None = None, secret: bytes | None = None,
                 traffic_class: KVTrafficClass | None = None) -> None:
        """`host_bounce`: see `PrefillRemote`; `secret`: the cluster's side-channel secret,
        proved to each decode instance's service; `traffic_class`: the fabric class of this
        worker's NIXL transfers."""
        self.kv = kv
        self.secret = secret
        self.page_bytes = kv.page_bytes
        self._bases = paged_kv_bases(kv_caches, kv.layer_names, kv.page_bytes)
        self.layers = [kv_caches[name] for name in kv.layer_names]
        counts = np.array([kv_caches[n].shape[0] for n in kv.layer_names], dtype=np.int64)
        self._first_entry = np.concatenate(([0], np.cumsum(counts)[:-1]))
        """Layer -> the local list's entry of its block 0 (entry of block b: that + b)."""
        self._num_blocks = counts
        self._remotes: dict[str, tuple[Prepped, int]] = {}
        """decode side channel -> its staging slots' prepared list and the buffer's address."""
        is_cuda = any(layer.is_cuda for layer in self.layers)
        self.host_bounce = is_cuda if host_bounce is None else host_bounce
        self.link = NixlAgent(agent_name("prefill"), traffic_class=traffic_class)
        self._local: Prepped | None = None
        """Direct: every layer's page of every block of the paged KV (entry of layer l, block
        b: `_first_entry[l] + b`)."""
        self.bounces: BouncePool | None = None
        if self.host_bounce:
            self.bounces = BouncePool(self.link, len(self._bases), self.page_bytes,
                                      pinned=is_cuda)
        else:
            self.link.register_tensors(b.span for b in self._bases)
            self._local = self.link.prep(np.concatenate([
                np.uint64(b.address) + np.arange(count, dtype=np.uint64)
                * np.uint64(b.block_stride_bytes)
                for b, count in zip(self._bases, counts, strict=True)]), self.page_bytes)
        self._peers: dict[tuple[str, int], SideChannelClient] = {}
        """(decode side channel, thread) -> a connection (a background load's long `stage`
        never holds up the engine thread's pushes)."""
        self._agents: dict[str, str] = {}
        """decode side channel -> its NIXL agent name (again when a new connection finds a
        new one: a restarted decode instance)."""
        self._lock = threading.Lock()

    def peer(self, address: str) -> tuple[SideChannelClient, str]:
        """This thread's connection to the decode node at `address` and the node's NIXL agent
        (at first contact: connected, and its staging slots' list prepared)."""
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
                # one fail (`post`) and their requests recompute; new ones use this.
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

    def entries(self, de: str, pairs: Sequence[tuple[int, int]],
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

    def post(self, op: str, de: str, peer: str, entries: Indices, layers: slice,
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

    def stage_args(self, r: RemoteLoad) -> tuple[str, int, tuple[bytes, ...], int]:
        """A `stage` of `r` in this rank's names: its transfer, its shard's keys of the files
        holding its blocks (the decode rank of the same index reads this rank's files) and
        how many blocks."""
        shard = self.kv.shard
        return (shard.xfer(r.xfer), r.blocks.first_block, tuple(map(shard.key, r.blocks.keys)),
                len(r.blocks.block_ids))

    def drop(self, address: str) -> None:
        """Close this thread's connection to `address` (the next `peer` opens a new one)."""
        with self._lock:
            client = self._peers.pop((address, threading.get_ident()), None)
        if client is not None:
            client.close()

    def close(self) -> None:
        with self._lock:
            clients = list(self._peers.values())
            self._peers.clear()
        for client in clients:
            client.close()
        with contextlib.suppress(Exception):
            if self.bounces is not None:
                self.bounces.close()
        with contextlib.suppress(Exception):
            self.link.close()
