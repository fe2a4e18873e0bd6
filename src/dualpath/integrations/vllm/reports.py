"""What a node tells the router about its engines: the paper's leader engine, which reports its
group's state (`seq`, `tok`, the node's read queue) when it fetches work.

A reporter beside a node's engines (the router's `dualpath route-report`, or a connector that
knows its node's read queue) POSTs a `NodeReport` to the router's `REPORT_PATH` every
`interval_s`. The router then stops polling those engines: a report is one small request per
node instead of two per engine, and at a thousand engines the polls alone would hold the
router's cores. A node whose reports stop for `MISSED_REPORTS` intervals has its engines
marked down (and polled again, as plain vLLM instances are); an engine a report says is not
up is marked down at once.

The message is JSON, `NodeReport.to_json`; `from_json` refuses a malformed one naming the
field. Engines are named by their base URL as the router was given it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from dualpath.core.errors import SpecError

REPORT_PATH = "/dualpath/report"
DEFAULT_INTERVAL_S = 0.5
MISSED_REPORTS = 3
"""Intervals without a report after which the router takes a node's engines for down."""


@dataclass(frozen=True)
class EngineState:
    """One engine's state as its node reports it (None: not known to the reporter)."""

    url: str
    is_up: bool
    running: int | None = None
    """Requests the engine is running (`vllm:num_requests_running`)."""
    waiting: int | None = None
    kv_usage: float | None = None
    """Fraction of its KV cache in use (`vllm:kv_cache_usage_perc`)."""
    kv_capacity_tokens: int | None = None
    """Tokens its KV cache holds (`num_gpu_blocks x block_size`)."""
    read_q_tokens: int | None = None
    """Hit tokens its node's storage NIC has queued (a connector knows it)."""


@dataclass(frozen=True)
class NodeReport:
    """A node's engines, as its reporter (the node's leader) saw them."""

    node: str
    interval_s: float
    engines: tuple[EngineState, ...]
    seq: int = 0
    """Increases with each report of one reporter (a late one is dropped)."""

    def __post_init__(self) -> None:
        if not self.node:
            raise SpecError("node report", "node", self.node, "must be a non-empty name")
        if not (isinstance(self.interval_s, float | int) and math.isfinite(self.interval_s)
                and self.interval_s > 0):
            raise SpecError("node report", "interval_s", self.interval_s, "must be > 0")

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> NodeReport:
        try:
            raw = json.loads(data)
        except ValueError as e:
            raise SpecError("node report", "body", "", f"not JSON: {e}") from e
        if not isinstance(raw, Mapping):
            raise SpecError("node report", "body", type(raw).__name__, "must be an object")
        engines = raw.get("engines")
        if not isinstance(engines, list):
            raise SpecError("node report", "engines", engines, "must be a list")
        return cls(node=_field(raw, "node", str), interval_s=float(_field(raw, "interval_s",
                                                                           (int, float))),
                   engines=tuple(_engine(e, k) for k, e in enumerate(engines)),
                   seq=_optional(raw, "seq", int, "node report") or 0)


def _field(raw: Mapping[str, Any], name: str, kind: type | tuple[type, ...],
           where: str = "node report") -> Any:
    value = raw.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise SpecError(where, name, value, f"missing or not a {getattr(kind, '__name__', kind)}")
    return value


def _optional(raw: Mapping[str, Any], name: str, kind: type, where: str) -> Any:
    value = raw.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kind | int):
        raise SpecError(where, name, value, f"must be a {kind.__name__} or null")
    return kind(value)


def _engine(raw: Any, k: int) -> EngineState:
    where = f"node report engines[{k}]"
    if not isinstance(raw, Mapping):
        raise SpecError(where, "engine", raw, "must be an object")
    return EngineState(url=_field(raw, "url", str, where), is_up=_field(raw, "is_up", bool, where),
                       running=_optional(raw, "running", int, where),
                       waiting=_optional(raw, "waiting", int, where),
                       kv_usage=_optional(raw, "kv_usage", float, where),
                       kv_capacity_tokens=_optional(raw, "kv_capacity_tokens", int, where),
                       read_q_tokens=_optional(raw, "read_q_tokens", int, where))
