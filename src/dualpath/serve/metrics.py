"""`GET /metrics`: Prometheus text format (`prometheus-client`), one registry per server.

vLLM's names where vLLM has the quantity (so dashboards and load generators such as aiperf
read them unchanged), `dualpath:` names for DualPath's own. Counters and gauges are derived at
scrape time from the engine's `ServeStats` and the nodes' latest `NodeStats` (nothing is
counted twice, so they match `/stats`); the latency histograms are observed as requests finish.

    vllm:num_requests_running / _waiting     gauges (decoding / no token out yet)
    vllm:time_to_first_token_seconds         histogram
    vllm:inter_token_latency_seconds         histogram (one observation per token after the first)
    vllm:e2e_request_latency_seconds         histogram
    vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:request_success_total
    vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total   (tokens)
    dualpath:storage_read_bytes_total{path="pe"|"de"}   KV read from storage per read path
    dualpath:storage_nic_busy_seconds_total{node}       each node's storage-NIC read port
    dualpath:storage_nic_utilization{node}              busy fraction over the last report
    dualpath:storage_read_queue_tokens{node}            tokens queued for storage reads
    dualpath:storage_tokens_total                       prompt tokens served from storage
    dualpath:recomputed_blocks_total{reason}            missing / corrupt blocks recomputed
    dualpath:cluster_restarts_total
    dualpath:unpersisted_blocks_total
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dualpath.http.exposition import counter, family, gauge
from dualpath.runtime.messages import NodeStats
from dualpath.serve.engine import Finished, ServingEngine

# vLLM's buckets.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def storage_counters(engine: ServingEngine) -> dict[str, Any]:
    """The running cluster's storage counters from its nodes' latest reports (what `/stats`
    and `/metrics` both show; a restarted cluster starts again from zero)."""
    cluster = engine.cluster
    nodes: list[NodeStats] = [cluster.live_stats[n] for n in sorted(cluster.live_stats)]
    read_bytes = {"pe": 0, "de": 0}
    per_node = []
    missing = corrupt = 0
    for st in nodes:
        side = "pe" if st.node < engine.cfg.num_prefill_nodes else "de"
        read_bytes[side] += st.bytes_by_path.get("snic_read", 0)
        missing += st.store_counters.get("num_misses", 0)
        corrupt += st.store_counters.get("num_corrupt", 0)
        per_node.append({
            "node": st.node, "side": side,
            "storage_read_busy_s": st.port_busy_s.get(f"n{st.node}.snic.read", 0.0),
            "read_queue_tokens": st.read_q_tokens, "taken_at": st.taken_at,
        })
    return {"read_bytes": read_bytes, "nodes": per_node,
            "recomputed_blocks": {"missing": missing, "corrupt": corrupt}}


class ServeMetrics:
    """The registry of one server: histograms it observes, the rest collected on scrape."""

    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._model = engine.model_name
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=TTFT_BUCKETS_S, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens.",
                             labels, buckets=ITL_BUCKETS_S, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             labels, buckets=E2E_BUCKETS_S, registry=self.registry)
        self.registry.register(_EngineCollector(self))
        self._busy: dict[int, tuple[float, float]] = {}
        """Per node: (busy_s, taken_at) of the report before the latest, for utilization."""
        self._utilization: dict[int, float] = {}

    def observe(self, fin: Finished) -> None:
        """A finished request's latencies (cluster timestamps)."""
        self.ttft.labels(self._model).observe(fin.ttft_s)
        self.e2e.labels(self._model).observe(fin.total_s)
        n = len(fin.output_ids)
        if n > 1:
            gap = max(0.0, fin.total_s - fin.ttft_s) / (n - 1)
            itl = self.itl.labels(self._model)
            for _ in range(n - 1):
                itl.observe(gap)

    def utilization(self, node: dict[str, Any]) -> float:
        """Busy fraction of a node's storage-NIC read port between its last two reports."""
        n, busy, at = node["node"], node["storage_read_busy_s"], node["taken_at"]
        prev = self._busy.get(n)
        if prev is None or at > prev[1]:
            if prev is not None and at > prev[1]:
                self._utilization[n] = min(1.0, max(0.0, (busy - prev[0]) / (at - prev[1])))
            self._busy[n] = (busy, at)
        return self._utilization.get(n, 0.0)


class _EngineCollector(Collector):
    def __init__(self, metrics: ServeMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        eng = m.engine
        model = eng.model_name
        s = eng.stats
        waiting, running = eng.num_in_flight()
        yield gauge("vllm:num_requests_running", "Requests decoding.", model, running)
        yield gauge("vllm:num_requests_waiting", "Requests with no token out yet.", model,
                    waiting)
        yield counter("vllm:prompt_tokens", "Prompt tokens.", model, s.num_prompt_tokens)
        yield counter("vllm:generation_tokens", "Generated tokens.", model,
                      s.num_generated_tokens)
        yield counter("vllm:request_success", "Finished requests.", model, s.num_finished)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the KV store.",
                      model, s.num_prompt_tokens)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the KV store.", model,
                      s.num_cached_tokens)
        yield counter("dualpath:storage_tokens", "Prompt tokens whose KV was read from storage.",
                      model, s.num_cached_tokens)
        yield counter("dualpath:cluster_restarts", "Cluster restarts after a failure.", model,
                      eng.num_restarts)
        yield counter("dualpath:unpersisted_blocks",
                      "KV blocks that could not be persisted (full disk, read-only store); "
                      "each is a later cache miss.", model, eng.num_unpersisted_blocks)
        storage = storage_counters(eng)
        yield family(CounterMetricFamily, "dualpath:storage_read_bytes",
                     "KV bytes read from storage, per read path.", model, ["path"],
                     [((path,), b) for path, b in storage["read_bytes"].items()])
        nodes = [((str(n["node"]), n["side"]), n) for n in storage["nodes"]]
        per_node = ["node", "side"]
        yield family(CounterMetricFamily, "dualpath:storage_nic_busy_seconds",
                     "Storage-NIC read port busy time (emulated NIC).", model, per_node,
                     [(key, n["storage_read_busy_s"]) for key, n in nodes])
        yield family(GaugeMetricFamily, "dualpath:storage_nic_utilization",
                     "Storage-NIC read port busy fraction over the last report.", model,
                     per_node, [(key, m.utilization(n)) for key, n in nodes])
        yield family(GaugeMetricFamily, "dualpath:storage_read_queue_tokens",
                     "Tokens queued for storage reads.", model, per_node,
                     [(key, n["read_queue_tokens"]) for key, n in nodes])
        yield family(CounterMetricFamily, "dualpath:recomputed_blocks",
                     "KV blocks found missing or corrupt and recomputed.", model, ["reason"],
                     [((reason,), n) for reason, n in storage["recomputed_blocks"].items()])
