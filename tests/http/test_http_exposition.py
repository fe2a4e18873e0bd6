"""Prometheus families from `dualpath.http.exposition`, read back with prometheus-client's
own parser."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from dualpath.http.exposition import CONTENT_TYPE, counter, family, gauge, metrics_response


class _Fixed(Collector):
    def collect(self) -> Iterator[Metric]:
        yield counter("demo:requests", "Requests.", "m", 3)
        yield gauge("demo:waiting", "Waiting.", "m", 1.5)
        yield family(GaugeMetricFamily, "demo:queue_tokens", "Per node.", "m",
                     ["node", "side"], [(("0", "pe"), 10), (("1", "de"), 20)])
        yield family(CounterMetricFamily, "demo:empty", "No samples yet.", "m", ["path"])


def test_families_carry_the_model_first_and_parse_back() -> None:
    registry = CollectorRegistry()
    registry.register(_Fixed())
    resp = metrics_response(registry)
    assert resp.media_type == CONTENT_TYPE
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(bytes(resp.body).decode())
               for s in fam.samples}
    m = ("model_name", "m")
    assert samples == {
        ("demo:requests_total", (m,)): 3.0,
        ("demo:waiting", (m,)): 1.5,
        ("demo:queue_tokens", (m, ("node", "0"), ("side", "pe"))): 10.0,
        ("demo:queue_tokens", (m, ("node", "1"), ("side", "de"))): 20.0,
    }
