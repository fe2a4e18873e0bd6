"""Prometheus text exposition for the front ends' `/metrics` (`prometheus-client`): metric
families labelled with the served model, and the page's response.

Every family carries `model_name` first (as vLLM's do), then its own labels."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Row = tuple[Sequence[str], float]
"""One sample: its label values (after `model_name`) and its value."""


def family(kind: type[CounterMetricFamily] | type[GaugeMetricFamily], name: str, doc: str,
           model: str, labels: Sequence[str] = (), rows: Iterable[Row] = ()) -> Metric:
    """A counter or gauge family `name` whose samples are `rows`, each labelled `model`."""
    f = kind(name, doc, labels=["model_name", *labels])
    for values, value in rows:
        f.add_metric([model, *values], value)
    return f


def counter(name: str, doc: str, model: str, value: float) -> Metric:
    """A counter family of one sample (`name` gains `_total` when exposed)."""
    return family(CounterMetricFamily, name, doc, model, (), [((), value)])


def gauge(name: str, doc: str, model: str, value: float) -> Metric:
    """A gauge family of one sample."""
    return family(GaugeMetricFamily, name, doc, model, (), [((), value)])


def metrics_response(registry: CollectorRegistry) -> Response:
    """`GET /metrics`: the registry rendered now."""
    return Response(generate_latest(registry), media_type=CONTENT_TYPE)
