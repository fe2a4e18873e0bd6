"""The router's Prometheus families, `dualpath_router:*`, from `Router.stats()`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dualpath.http import exposition
from dualpath.integrations.vllm.router.router import Router


class RouterCollector(Collector):
    """`dualpath_router:*` from `Router.stats()` at scrape time (so they match `/stats`)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        s = self.router.stats()

        def one(kind: type[CounterMetricFamily] | type[GaugeMetricFamily], name: str,
                doc: str, labels: Sequence[str], rows: Sequence[exposition.Row]) -> Metric:
            return exposition.family(kind, f"dualpath_router:{name}", doc, s["model"], labels,
                                     rows)

        yield one(CounterMetricFamily, "requests", "Requests placed, per read path "
                  "(pe, de, split: both sides read, none: no stored prefix).", ["path"],
                  [((p,), n) for p, n in s["requests_by_path"].items()])
        yield one(CounterMetricFamily, "hit_blocks", "Stored KV blocks assigned to each "
                  "read side.", ["side"],
                  [((k,), n) for k, n in s["hit_blocks_by_side"].items()])
        yield one(CounterMetricFamily, "hit_bytes", "Stored KV bytes assigned to each read "
                  "side.", ["side"], [((k,), n) for k, n in s["hit_bytes_by_side"].items()])
        yield one(CounterMetricFamily, "loaded_blocks", "Stored KV blocks the prefill "
                  "instances' connectors reported loaded, per read side.", ["side"],
                  [((k,), n) for k, n in s["loaded_blocks_by_side"].items()])
        yield one(CounterMetricFamily, "recomputed_blocks", "Stored KV blocks planned to "
                  "load that were recomputed (a load failed).", [],
                  [((), s["recomputed_blocks"])])
        yield one(CounterMetricFamily, "finished_requests", "Requests answered.", [],
                  [((), s["finished"])])
        yield one(CounterMetricFamily, "aborted_requests", "Requests ended by an error, a "
                  "timeout or a client gone.", [], [((), s["aborted"])])
        yield one(CounterMetricFamily, "queue_timeouts", "Requests no instance took in "
                  "time (503).", [], [((), s["queue_timeouts"])])
        yield one(CounterMetricFamily, "retries", "Requests placed again after an instance "
                  "failed them before their first token.", [], [((), s["retries"])])
        yield one(CounterMetricFamily, "stream_errors", "Streams that broke after their "
                  "first event (ended with an error event).", [], [((), s["stream_errors"])])
        yield one(GaugeMetricFamily, "waiting_requests", "Requests not yet placed.", [],
                  [((), s["waiting"])])
        instances = [(role, inst) for role in ("prefill", "decode") for inst in s[role]]
        labels = ["role", "instance", "node"]

        def rows(key: str) -> list[exposition.Row]:
            return [((role, inst["url"], str(inst["node"])), inst[key])
                    for role, inst in instances if inst.get(key) is not None]

        yield one(GaugeMetricFamily, "read_queue_tokens", "Hit tokens queued on the node's "
                  "storage NIC (requests whose prefill has not replied).", labels,
                  rows("read_queue_tokens"))
        yield one(GaugeMetricFamily, "up", "1 while the instance takes new requests, 0 "
                  "while it is marked down.", labels,
                  [((role, inst["url"], str(inst["node"])), int(inst["up"]))
                   for role, inst in instances])
        yield one(GaugeMetricFamily, "in_flight_requests", "Requests routed to the "
                  "instance and not done with it.", labels, rows("in_flight"))
        yield one(GaugeMetricFamily, "in_flight_tokens", "Prompt tokens of those "
                  "requests.", labels, rows("in_flight_tokens"))
        yield one(GaugeMetricFamily, "free_kv_bytes", "A decode instance's KV memory for "
                  "new requests (when its capacity is known).", labels, rows("free_kv_bytes"))
        yield one(CounterMetricFamily, "upstream_errors", "Failures of the instance "
                  "(unreachable, timed out, 5xx).", labels, rows("upstream_errors"))

