"""The connector's worker side, one per vLLM worker (`WorkerSide`): the store's Full Blocks
(`kvio.KVWorker`), a prefill's DE pulls and pushes (`remote.PrefillRemote`) and background
loads (`async_loader.AsyncLoader`), a decode's loads from its staging buffer
(`decode_remote.DecodeRemote`) and that buffer's side-channel process, driven in vLLM's
calling order: `bind`, `start_load`, `wait_for_layer` and `save_layer` per layer,
`wait_for_save`. `dualpath_connector.DualPathConnector` hands it vLLM's calls.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

import torch

from dualpath.integrations.vllm.connector.async_loader import AsyncLoader
from dualpath.integrations.vllm.connector.decode_remote import DecodeRemote
from dualpath.integrations.vllm.connector.kvio import KVWorker
from dualpath.integrations.vllm.connector.layout import Layout
from dualpath.integrations.vllm.connector.remote import PrefillRemote
from dualpath.integrations.vllm.connector.side_channel.client import RemotePool
from dualpath.integrations.vllm.connector.side_channel.service import (
    spawn_side_channel,
    staging_slots,
)
from dualpath.integrations.vllm.connector.step_plan import StepPlan
from dualpath.integrations.vllm.connector.worker_record import WorkerCounters
from dualpath.integrations.vllm.manifest import Shard
from dualpath.store import BlockStore
from dualpath.transport.pacing import Pacer
from dualpath.transport.traffic_class import KVTrafficClass

if TYPE_CHECKING:
    from dualpath.integrations.vllm.connector.vllm_metrics import DualPathStats

logger = logging.getLogger("vllm.dualpath_connector")
"""The connector's logger (`dualpath_connector.logger`, under vLLM's "vllm" logger)."""


class WorkerSide:
    """What a worker's connector moves per step, by role: store loads and saves on every
    role, DE pulls and pushes on a prefill, staged loads on a decode."""

    def __init__(self, store: BlockStore, layout: Layout, role: str, extra: Any, shard: Shard,
                 secret: bytes | None, host_bounce: bool | None,
                 storage_read_gbps: float | None) -> None:
        """`extra`: vLLM's `KVTransferConfig` (its `kv_connector_extra_config`); `role`: the
        connector's P/D role ("both", "prefill", "decode")."""
        self.store = store
        self.layout = layout
        self.role = role
        self.secret = secret
        """The cluster's side-channel secret (None: unauthenticated, loopback only)."""
        self.host_bounce = host_bounce
        """Prefill: DE pulls and pushes through pinned host buffers (None: where the KV is on
        a GPU; `PrefillRemote`)."""
        self.storage_read_gbps = storage_read_gbps
        self.traffic_class = KVTrafficClass.from_extra_config(extra.get_from_extra_config)
        """The fabric class of this worker's NIXL transfers, both ends (`kv_ib_sl`,
        `kv_traffic_class`)."""
        self.prefill: PrefillRemote | None = None
        self.decode: DecodeRemote | None = None
        self.side_address: str | None = None
        """Decode: where prefill workers reach this node's staging buffer."""
        self.side_process: Any = None
        self.side_pool: RemotePool | None = None
        self.loader: AsyncLoader | None = None
        self.plan = StepPlan()
        """The step's plan (from `bind`)."""
        self.counted = WorkerCounters()
        """Its counters when last taken (`add_stats`)."""
        # The worker's emulated storage NIC. On a decode node the staging service reads through
        # its own (the worker reads the store only for requests without the router's orders).
        pacer = Pacer.from_gbps(storage_read_gbps, "storage_read") \
            if storage_read_gbps else None
        # A decode node writes its new blocks in the background by default: its steps are
        # the latency users see, and the next turn comes after a router round trip.
        self.kv = KVWorker(
            store, layout.layer_names, layout.page_bytes,
            event_log=extra.get_from_extra_config("event_log", None), pacer=pacer,
            background_saves=bool(extra.get_from_extra_config(
                "background_saves", role == "decode")),
            shard=shard,
            read_threads=int(extra.get_from_extra_config("read_threads", 16)),
            write_threads=int(extra.get_from_extra_config("write_threads", 4)),
            blocks_per_file=layout.blocks_per_file)
        if role == "decode":
            self._start_side_channel(extra)
        self.kv.log_event({"event": "init", "role": role,
                           "namespace": layout.namespace.hex(),
                           "block_size": layout.block_size,
                           "full_block_bytes": layout.full_block_bytes,
                           "blocks_per_file": layout.blocks_per_file,
                           "layers": len(layout.layer_names),
                           "shard": asdict(self.kv.shard),
                           "side_channel": self.side_address})

    def _start_side_channel(self, extra: Any) -> None:
        address = extra.get_from_extra_config("side_channel", None)
        if not address:
            raise ValueError("DualPathConnector with kv_role kv_consumer (a decode instance) "
                             "needs kv_connector_extra_config.side_channel, host:port")
        # Each rank serves its own shards' staging buffer, on the instance's port + its index.
        address = self.kv.shard.side_channel(str(address))
        self.side_process, pool = spawn_side_channel(
            str(address), str(self.store.root), self.layout.full_block_bytes,
            staging_slots(self.layout.full_block_bytes,
                          extra.get_from_extra_config("staging_gb", None),
                          extra.get_from_extra_config("staging_blocks", None)),
            self.storage_read_gbps, extra.get_from_extra_config("event_log", None),
            self.layout.namespace.hex(),
            read_threads=int(extra.get_from_extra_config("read_threads", 16)),
            blocks_per_file=self.layout.blocks_per_file, secret=self.secret,
            traffic_class=self.traffic_class)
        self.side_pool = pool
        self.side_address = str(address)
        self.decode = DecodeRemote(self.kv, pool)
        logger.info("DualPathConnector: side channel process on %s, %d staging blocks "
                    "(%d MiB)", address, pool.num_slots,
                    pool.num_slots * pool.full_block_bytes >> 20)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv.register(kv_caches)
        if self.role == "prefill":
            # Through pinned host buffers where the KV is on a GPU, unless said otherwise:
            # without GPUDirect RDMA, UCX emulates host <-> VRAM transfers over TCP.
            self.prefill = PrefillRemote(self.kv, kv_caches, self.host_bounce,
                                         secret=self.secret, traffic_class=self.traffic_class)
            self.loader = AsyncLoader(self.kv, self.prefill)

    def close(self) -> None:
        self.kv.close()  # the background saves land first
        if self.loader is not None:
            self.loader.close()
        if self.prefill is not None:
            self.prefill.close()
        if self.side_pool is not None:
            self.side_pool.close()
        if self.side_process is not None:
            self.side_process.terminate()

    def bind(self, plan: StepPlan) -> None:
        self.plan = plan
        self.kv.bind(plan)
        if self.prefill is not None:
            self.prefill.bind(plan)
        if self.decode is not None:
            self.decode.bind(plan)

    def start_load(self) -> None:
        # Synchronous: vLLM calls this (`start_load_kv`) before the forward when a step has
        # loads. The reads of whole Full Blocks finish here; the per-layer copies run in
        # `wait_for_layer`. The DE-side pulls are posted here too, one NIXL READ per layer;
        # each layer waits for its own in `wait_for_layer`.
        if self.prefill is not None:
            self.prefill.request_stages()  # the decode nodes read while this one does
        self.kv.load()
        if self.prefill is not None:
            self.prefill.load()
        if self.loader is not None:
            self.loader.submit(self.plan)
        if self.decode is not None:
            self.decode.load()

    def wait_for_layer(self, layer_name: str, kv_cache: torch.Tensor) -> None:
        if self.prefill is not None:
            self.prefill.inject(layer_name)
        self.kv.inject(layer_name, kv_cache)
        if self.decode is not None:
            self.decode.inject(layer_name, kv_cache)

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        self.kv.capture(layer_name, kv_layer)
        if self.prefill is not None:
            self.prefill.capture(layer_name)

    def wait_for_save(self) -> None:
        if self.prefill is not None:
            self.prefill.flush()
        self.kv.flush()
        if self.decode is not None:
            self.decode.flush()

    def finished_loads(self) -> set[str] | None:
        """Requests whose background loads are done (vLLM's `finished_recving`; their
        failed blocks are reported no later than this); None without background loads."""
        return self.loader.take_finished() if self.loader is not None else None

    def add_stats(self, stats: DualPathStats) -> None:
        """Its counts since the last call into `stats`: saves, errors and read queues."""
        now = self.kv.counters
        last, self.counted = self.counted, replace(now)
        stats.add(saved_blocks=now.saved_blocks - last.saved_blocks,
                  failed_saves=now.failed_saves - last.failed_saves,
                  remote_errors=now.remote_errors - last.remote_errors)
        if self.loader is not None:
            stats.set_queue(self.loader.queued_blocks())

    def take_load_errors(self) -> set[int]:
        """vLLM block ids that failed to load since the last call."""
        errors = self.kv.take_load_errors()
        if self.loader is not None:
            errors |= self.loader.take_errors()
        return errors
