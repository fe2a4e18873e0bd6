"""`DualPathConnector`: a vLLM v1 KV connector over DualPath's checksummed `BlockStore`.

Register it with

    KVTransferConfig(kv_connector="DualPathConnector", kv_role="kv_both",
                     kv_connector_module_path="dualpath.integrations.vllm.connector.dualpath_connector",
                     kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"store_path": "/path/to/store"})

Extra config: `store_path` (required; a folder, local or a shared mount), `durable` (fsync
each block, default true), `event_log` (a JSON-lines file of loads and saves, default none),
`background_saves` (write new blocks from a writer thread, not in the step; default true on a
decode instance, false otherwise), `read_threads` / `write_threads` (store reads and writes
in flight per worker, default 16 / 4; a decode instance's staging service reads
`read_threads` at a time too), `staging_gb` or `staging_blocks` (a decode instance's
staging buffer, in GB, default 2, or in Full Blocks), `store_capacity_gb` (the store keeps
about that many GB, evicting the least recently used blocks; default none: every block),
`blocks_per_file` (vLLM blocks per store file, an integer >= 1; default: files of at least 128
tokens, `max(1, 128 // block_size)`, so 8 for vLLM's 16-token blocks, 1 for 128-token ones;
every instance on a store must use the same, and the router reads it from the manifest),
`kv_ib_sl` / `kv_traffic_class` (the InfiniBand service level, 0-15, and RoCE traffic class,
0-255, of the P/D KV transfers, set on the connector's NIXL agents' UCX contexts only; default:
the fabric's; `transport.traffic_class`).

On every instance, every full block of every request is persisted when the step that
computes its last token ends; a later request whose prefix is
stored loads it from the store into the paged KV (read before the forward, injected layer by
layer just before each layer's attention). A block that is missing or fails its checksum is
reported through `get_block_ids_with_load_errors`; with `kv_load_failure_policy="recompute"`
vLLM recomputes it (vLLM's default, "fail", fails the request instead). Between P/D
instances the router's `RouteParams` choose the read path per request: the prefill instance
reads PE-side blocks itself and pulls DE-side blocks from the decode node's staging buffer
layer by layer (`remote`); the decode instance loads the prompt's KV from staging.

This module imports vllm; the logic is in modules that import without it: `layout` (the KV's
shape and the key namespace), `plan` (the scheduler side), `worker_side` (the worker side).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from dualpath.core.errors import SpecError
from dualpath.integrations.vllm.connector.bounce import host_bounce_option
from dualpath.integrations.vllm.connector.compat import (
    DISK_HIT_SOURCE,
    HEADS_FIRST_LAYOUT,
    resumed_req_ids,
)
from dualpath.integrations.vllm.connector.layout import layout_of
from dualpath.integrations.vllm.connector.plan import Planner
from dualpath.integrations.vllm.connector.scope import request_scope
from dualpath.integrations.vllm.connector.side_channel.auth import load_secret
from dualpath.integrations.vllm.connector.step_plan import StepPlan
from dualpath.integrations.vllm.connector.vllm_metrics import (
    DualPathPromMetrics,
    DualPathStats,
    storage_events,
)
from dualpath.integrations.vllm.connector.worker_side import WorkerSide
from dualpath.integrations.vllm.manifest import RouteParams, Shard, StoreManifest
from dualpath.store import BlockStore, store_file_mode

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.dualpath_connector")
"""Under vLLM's "vllm" logger, so its handler and level (VLLM_LOGGING_LEVEL) apply: the
connector's INFO lines (a request's hits, what a routed prefill loaded, with vLLM's request
id, which carries the router's X-Request-Id) are in the instance's log."""

PD_ROLES = {"kv_both": "both", "kv_producer": "prefill", "kv_consumer": "decode"}
"""vLLM's kv_role -> the connector's role in DualPath's P/D flow (`plan.Planner.role`)."""


@dataclass
class DualPathConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    plan: StepPlan


def _worker_shard(tp_size: int, pp_size: int) -> Shard:
    """This worker's tensor- and pipeline-parallel ranks (vLLM's parallel state, set up before
    a worker's connector is made)."""
    if tp_size * pp_size == 1:
        return Shard()
    from vllm.distributed.parallel_state import (
        get_pp_group,
        get_tensor_model_parallel_rank,
    )

    return Shard(get_tensor_model_parallel_rank(), tp_size, get_pp_group().rank_in_group,
                 pp_size)


class DualPathConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """Persists full KV blocks to a `BlockStore` and loads stored prefixes back."""

    _cache_hit_source = DISK_HIT_SOURCE

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a best-effort cache. Its saves and pushes end inside the step that fills a
        block, so a request preempted after that step has no hand-off to protect; vLLM's
        default (the kv_role's `is_kv_producer`) would drop and recompute its in-flight
        output."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Always: every role works inside the forward, per layer (`wait_for_layer_load`
        injects loaded pages and waits for NIXL pulls, `save_kv_layer` captures pages to save
        and posts pushes). A full CUDA graph replays the whole forward without those Python
        hooks, so a routed request on a decode instance (one token to compute: an all-decode
        batch, replayed as one full graph under vLLM's default FULL_AND_PIECEWISE) would never
        get its staged KV, and the blocks it fills would never be saved. Under PIECEWISE,
        attention runs outside the captured pieces and the hooks run around it."""
        return True

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """LBHNC (vLLM's HND): each block's page of a layer is one contiguous run in logical
        `[H, N, C]` order. The store's payload is that logical order, and NIXL moves raw page
        bytes between the decode node's staging slots and the prefill node's paged KV, so the
        physical order of a page must be the logical one (`pages.paged_kv_bases` refuses any
        other). vLLM's CUDA FlashAttention declares no layout and would get LBNHC (NHD, heads
        and tokens swapped inside a page). MLA's pages have one head: any order is the same."""
        model_config = vllm_config.model_config
        if model_config is not None and getattr(model_config, "use_mla", False):
            return None
        return HEADS_FIRST_LAYOUT

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config
        store_path = extra.get_from_extra_config("store_path", None)
        if not store_path:
            raise ValueError("DualPathConnector needs kv_connector_extra_config.store_path")
        if getattr(extra, "kv_load_failure_policy", "recompute") != "recompute":
            logger.warning("DualPathConnector: kv_load_failure_policy=%r fails a request whose "
                           "stored block is missing or corrupt; set 'recompute' to recompute "
                           "it", extra.kv_load_failure_policy)
        layout = layout_of(vllm_config, kv_cache_config,
                           extra.get_from_extra_config("blocks_per_file", None))
        self._layout = layout
        capacity_gb = extra.get_from_extra_config("store_capacity_gb", None)
        if capacity_gb is not None and not float(capacity_gb) > 0:
            raise ValueError(f"DualPathConnector: kv_connector_extra_config.store_capacity_gb "
                             f"must be > 0, got {capacity_gb!r}")
        self._store = BlockStore(store_path, layout.blocks_per_file * layout.full_block_bytes,
                                 is_durable=bool(extra.get_from_extra_config("durable", True)),
                                 capacity_bytes=None if capacity_gb is None
                                 else max(1, int(float(capacity_gb) * 1e9)),
                                 file_mode=store_file_mode(
                                     extra.get_from_extra_config("store_file_mode", None)))
        self._secret = load_secret(lambda key: extra.get_from_extra_config(key, None))
        """The cluster's side-channel secret (None: unauthenticated, loopback only)."""
        self._pd_role = PD_ROLES.get(str(extra.kv_role), "both")
        self._planner: Planner | None = None
        self._worker: WorkerSide | None = None
        self._stats = DualPathStats()
        """This side's counts since vLLM last took them (`get_kv_connector_stats`)."""
        self._requests: dict[str, Request] = {}
        """Scheduler: live requests (their vLLM block hashes and tokens, for KV events)."""
        self._events: list[KVCacheEvent] = []
        """Scheduler: KV events of the steps planned since vLLM last took them."""
        gbps = extra.get_from_extra_config("storage_read_gbps", None)
        self._host_bounce = host_bounce_option(extra.get_from_extra_config("de_pull_via_host",
                                                                           "auto"))
        """Prefill: DE pulls and pushes through pinned host buffers (None: where the KV is on
        a GPU; `PrefillRemote`)."""
        self._storage_read_gbps = float(gbps) if gbps else None
        parallel = vllm_config.parallel_config
        tp_size = int(parallel.tensor_parallel_size)
        pp_size = int(parallel.pipeline_parallel_size)
        if role == KVConnectorRole.SCHEDULER:
            # Keys are rank-agnostic here; a block is stored once its last shard is (the one
            # rule the router applies too: `StoreManifest.stored_key`).
            manifest = StoreManifest(namespace=layout.namespace.hex(),
                                     model=str(vllm_config.model_config.model),
                                     block_size=layout.block_size,
                                     full_block_bytes=layout.full_block_bytes,
                                     tp_size=tp_size, pp_size=pp_size,
                                     blocks_per_file=layout.blocks_per_file)
            store = self._store
            self._planner = Planner(
                layout.block_size, layout.namespace,
                lambda key: store.contains(manifest.stored_key(key)), role=self._pd_role,
                async_loads=bool(extra.get_from_extra_config("async_loads", False)),
                num_shards=tp_size * pp_size, blocks_per_file=layout.blocks_per_file)
            manifest.write(store_path)
        else:
            self._worker = WorkerSide(self._store, layout, self._pd_role, extra,
                                      _worker_shard(tp_size, pp_size), self._secret,
                                      self._host_bounce, self._storage_read_gbps)
        logger.info("DualPathConnector (%s, %s): store %s, %d layers x %d B pages, block %d "
                    "tokens, %d blocks a file", role.name, self._pd_role, store_path,
                    len(layout.layer_names), layout.page_bytes, layout.block_size,
                    layout.blocks_per_file)

    @property
    def side_channel_address(self) -> str | None:
        """Decode: where prefill workers reach this node's staging buffer."""
        return self._worker.side_address if self._worker is not None else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None:
            self._worker.register(kv_caches)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # -- worker side -----------------------------------------------------------------------
    def _bound_worker(self) -> WorkerSide | None:
        if self._worker is None or not self.has_connector_metadata():
            return None
        return self._worker

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self._worker is not None
        assert isinstance(connector_metadata, DualPathConnectorMetadata)
        self._worker.bind(connector_metadata.plan)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        worker = self._bound_worker()
        if worker is not None:
            worker.start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        worker = self._bound_worker()
        if worker is not None:
            _, _, kv_cache, _ = get_attention_context(layer_name)
            worker.wait_for_layer(layer_name, kv_cache)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        worker = self._bound_worker()
        if worker is not None:
            worker.save_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        worker = self._bound_worker()
        if worker is not None:
            worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                               set[str] | None]:
        # Background loads done (their failed blocks are reported no later than this pass).
        return None, self._worker.finished_loads() if self._worker is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's counts since the last call (`vllm_metrics.DualPathStats`): the
        scheduler's what the loads gave, a worker's its saves, errors and read queues."""
        if self._worker is not None:
            self._worker.add_stats(self._stats)
        return None if self._stats.is_empty() else self._stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return DualPathStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return DualPathPromMetrics(vllm_config, metric_types, labelnames,
                                   per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    # -- scheduler side --------------------------------------------------------------------
    def _sched(self) -> Planner:
        assert self._planner is not None, "scheduler-side call on a worker-side connector"
        return self._planner

    def _add(self, request: Request) -> None:
        try:
            route = RouteParams.from_params(request.kv_transfer_params)
        except SpecError as e:
            logger.warning("DualPathConnector: request %s: %s; served without DualPath's "
                           "P/D transfer", request.request_id, e)
            route = None
        scope, why = request_scope(request, self._layout.block_size)
        if scope is None:
            logger.info("DualPathConnector: request %s is not keyed (%s): served without "
                        "loads from or saves to the store", request.request_id, why)
            self._stats.add(unkeyed_requests=1)
        self._sched().add_request(request.request_id, request.all_token_ids, route,
                                  num_prompt_tokens=request.num_prompt_tokens, scope=scope)
        self._requests[request.request_id] = request

    def on_new_request(self, request: Request) -> None:
        self._add(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        planner = self._sched()
        if not planner.has_request(request.request_id):  # added before the connector was
            self._add(request)
        hit = planner.match(request.request_id, num_computed_tokens)
        if hit:
            logger.info("DualPathConnector: request %s hits %d stored tokens after %d local",
                        request.request_id, hit, num_computed_tokens)
        return hit, bool(hit) and planner.is_async(request.request_id)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._sched().after_alloc(request.request_id, num_external_tokens,
                                  blocks.get_block_ids()[0] if num_external_tokens else None)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        planner = self._sched()
        for new in scheduler_output.scheduled_new_reqs:
            planner.schedule_new(new.req_id, new.block_ids[0], new.num_computed_tokens,
                                 scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        resumed = resumed_req_ids(cached)
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            planner.schedule_cached(
                req_id, new_ids[0] if new_ids is not None else None,
                is_resumed=req_id in resumed,
                num_computed_tokens=cached.num_computed_tokens[i],
                num_scheduled_tokens=scheduler_output.num_scheduled_tokens[req_id])
        plan = planner.take_plan()
        self._events += storage_events(
            (self._block_run(s.req_id, s.first_block, len(s.block_ids)) for s in plan.saves),
            (), self._layout.block_size)
        return DualPathConnectorMetadata(plan=plan)

    def _block_run(self, req_id: str, first: int, num: int) -> tuple[list[Any], Any, list[int]]:
        """vLLM's block hashes of blocks `[first, first + num)` of a request, the hash before
        them and their token ids (nothing when vLLM computed no hashes for them)."""
        request = self._requests.get(req_id)
        hashes = list(getattr(request, "block_hashes", None) or ())
        if request is None or len(hashes) < first + num:
            return [], None, []
        bs = self._layout.block_size
        return ([maybe_convert_block_hash(h) for h in hashes[first:first + num]],
                maybe_convert_block_hash(hashes[first - 1]) if first else None,
                list(request.all_token_ids[first * bs:(first + num) * bs]))

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The blocks persisted by the steps planned since the last call (`BlockStored`) and
        those whose load failed (`BlockRemoved`), `medium="STORAGE"`."""
        events, self._events = self._events, []
        return events

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # The blocks whose load failed this step (vLLM recomputes them): the prefill's
        # LoadReport counts them recomputed, not loaded. vLLM finishes no request in the
        # step its load failed, so this comes before that request's `request_finished`.
        failed = self._sched().load_errors(connector_output.invalid_block_ids)
        if connector_output.invalid_block_ids:
            self._stats.add(load_errors=len(connector_output.invalid_block_ids))
        # A block the store failed to give (PE side: missing or corrupt, which the store
        # removes) is no longer in storage for a router until it is written again; a DE-side
        # failure may be the transfer's, and says nothing about the store.
        removed = [run[0][0] for run in (self._block_run(req_id, index, 1)
                                         for req_id, index, side in failed if side == "pe")
                   if run[0]]
        self._events += storage_events((), removed, self._layout.block_size)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        # Saves and pushes are synchronous within the step that fills a block: nothing is
        # pending, the blocks may be freed. A prefill instance hands the router the params
        # that tell the decode instance where its KV is.
        planner = self._sched()
        params = planner.finished_params(request.request_id)
        report = planner.load_report(request.request_id)
        if params is not None:  # a routed prefill: its request id carries the router's trace
            logger.info("DualPathConnector: request %s loaded %s", request.request_id, report)
        full = self._layout.full_block_bytes
        self._stats.add(loaded_blocks_pe=report.pe_blocks, loaded_blocks_de=report.de_blocks,
                        loaded_bytes_pe=report.pe_blocks * full,
                        loaded_bytes_de=report.de_blocks * full,
                        recomputed_blocks=report.recomputed_blocks)
        planner.finish(request.request_id)
        self._requests.pop(request.request_id, None)
        return False, params
