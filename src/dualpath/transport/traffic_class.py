"""The fabric class of the KV traffic: an InfiniBand service level and a RoCE traffic class for
the NIXL agents that move KV, set on their UCX backend and nowhere else.

On InfiniBand a queue pair's service level (SL) picks its virtual lane on every link (the
switches' and NICs' SL-to-VL maps); on RoCE the traffic-class byte of its packets carries the
DSCP (the byte's upper six bits) that NICs and switches map to a priority and an ETS queue.
UCX sets them per transport from its `IB_SL` and `IB_TRAFFIC_CLASS` settings; NCCL sets the
model collectives' own from `NCCL_IB_SL` and `NCCL_IB_TC`.

How the settings reach one agent only: NIXL's UCX backend takes an `engine_config` init
parameter, a comma-separated `KEY=VALUE` list of UCX settings without their `UCX_` prefix,
and applies it with `ucp_config_modify` to the UCX context it creates for that backend (UCX
logs each key as "apply UCT configuration" when it opens a transport). The environment is left
alone: `UCX_IB_SL` there would reach every UCX context the process creates, and NCCL never
reads UCX's settings, so the collectives keep `NCCL_IB_SL`/`NCCL_IB_TC`.

`tcp_ports` is the emulated hosts' analogue: UCX's TCP transport marks no DSCP, so a Linux link
classifies KV by the ports UCX listens on (`TCP_PORT_RANGE`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dualpath.core.errors import SpecError

EXTRA_KEYS = {"ib_sl": "kv_ib_sl", "traffic_class": "kv_traffic_class"}
"""The `kv_connector_extra_config` key of each setting."""


def _int_in(owner: str, field: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool):
        raise SpecError(owner, field, value, f"must be an integer in [{lo}, {hi}]")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise SpecError(owner, field, value, f"must be an integer in [{lo}, {hi}]") from None
    if number != value and str(number) != str(value).strip():
        raise SpecError(owner, field, value, f"must be an integer in [{lo}, {hi}]")
    if not lo <= number <= hi:
        raise SpecError(owner, field, value, f"must be an integer in [{lo}, {hi}]")
    return number


@dataclass(frozen=True)
class KVTrafficClass:
    """The KV agents' class on the fabric; None leaves a setting at UCX's default (the
    fabric's default class). Frozen, validated."""

    ib_sl: int | None = None
    """InfiniBand service level, 0-15."""
    traffic_class: int | None = None
    """RoCE traffic-class byte, 0-255: the DSCP times 4 (plus ECN bits)."""
    tcp_ports: tuple[int, int] | None = None
    """First and last TCP port UCX's TCP transport listens on (emulated hosts)."""

    def __post_init__(self) -> None:
        owner = "kv_traffic_class"
        if self.ib_sl is not None:
            _int_in(owner, "ib_sl", self.ib_sl, 0, 15)
        if self.traffic_class is not None:
            _int_in(owner, "traffic_class", self.traffic_class, 0, 255)
        if self.tcp_ports is not None:
            lo, hi = self.tcp_ports
            _int_in(owner, "tcp_ports", lo, 1024, 65535)
            _int_in(owner, "tcp_ports", hi, lo, 65535)

    @property
    def dscp(self) -> int | None:
        """The DSCP a RoCE packet of this class carries."""
        return None if self.traffic_class is None else self.traffic_class >> 2

    @property
    def is_default(self) -> bool:
        return self.ucx_settings() == {}

    def ucx_settings(self) -> dict[str, str]:
        """UCX's names (without `UCX_`) and values of the settings given."""
        out: dict[str, str] = {}
        if self.ib_sl is not None:
            out["IB_SL"] = str(self.ib_sl)
        if self.traffic_class is not None:
            out["IB_TRAFFIC_CLASS"] = str(self.traffic_class)
        if self.tcp_ports is not None:
            out["TCP_PORT_RANGE"] = f"{self.tcp_ports[0]}-{self.tcp_ports[1]}"
        return out

    def backend_params(self) -> dict[str, str]:
        """NIXL UCX backend init parameters that apply the settings to that backend's UCX
        context only (empty: none to apply)."""
        settings = self.ucx_settings()
        if not settings:
            return {}
        return {"engine_config": ",".join(f"{k}={v}" for k, v in settings.items())}

    def extra_config(self) -> dict[str, int]:
        """The `kv_connector_extra_config` entries that give a connector this class."""
        out: dict[str, int] = {}
        for field, key in EXTRA_KEYS.items():
            value = getattr(self, field)
            if value is not None:
                out[key] = value
        return out

    def to_json(self) -> str:
        """This class as one JSON object (to hand to another process)."""
        return json.dumps({"ib_sl": self.ib_sl, "traffic_class": self.traffic_class,
                           "tcp_ports": self.tcp_ports})

    @classmethod
    def from_json(cls, text: str) -> KVTrafficClass:
        """The class `to_json` wrote."""
        data = json.loads(text)
        ports = data.get("tcp_ports")
        return cls(ib_sl=data.get("ib_sl"), traffic_class=data.get("traffic_class"),
                   tcp_ports=None if ports is None else (int(ports[0]), int(ports[1])))

    @classmethod
    def from_extra_config(cls, get: Callable[[str, Any], Any]) -> KVTrafficClass:
        """The class a connector's `kv_connector_extra_config` gives (`get(key, default)`); a
        bad value raises a `SpecError` naming its key."""
        values: dict[str, int | None] = {}
        for field, key in EXTRA_KEYS.items():
            raw = get(key, None)
            hi = 15 if field == "ib_sl" else 255
            values[field] = None if raw is None else _int_in(
                "kv_connector_extra_config", key, raw, 0, hi)
        return cls(ib_sl=values["ib_sl"], traffic_class=values["traffic_class"])
