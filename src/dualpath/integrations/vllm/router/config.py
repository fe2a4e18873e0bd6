"""The router's configuration: its instances, the store and the policy, fixed at start."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dualpath.core.errors import SpecError
from dualpath.integrations.vllm.manifest import StoreManifest
from dualpath.integrations.vllm.router.loads import Layout
from dualpath.sched.mode import mode_preset
from dualpath.sched.params import SchedulerParams
from dualpath.sched.types import Role


@dataclass(frozen=True)
class RouterConfig:
    """The instances, the store and the policy of one router."""

    prefill: tuple[str, ...]
    """Base URLs of the prefill instances (`http://host:port`)."""
    decode: tuple[str, ...]
    sides: tuple[str, ...]
    """host:port of each decode instance's side channel (`RouteParams.de`)."""
    store: Path
    manifest: StoreManifest
    params: SchedulerParams
    mode: str
    model: str | None = None
    """The model name put in a request that names none (default: the instances' choice)."""
    queue_timeout_s: float = 60.0
    upstream_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    poll_interval_s: float = 0.5
    decode_kv_capacity_bytes: int | None = None
    forced_read_side: str | None = None
    """"pe" / "de": every hit read on that side (`--force-read-side`)."""
    prefill_nodes: tuple[str, ...] | None = None
    """The node of each prefill instance (instances of one node share its storage NIC and
    report together); None: each its own node."""
    decode_nodes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise SpecError("route", "instances", (len(self.prefill), len(self.decode)),
                            "needs at least one --prefill and one --decode")
        if len(self.sides) != len(self.decode):
            raise SpecError("route", "side", len(self.sides),
                            f"one --side per --decode ({len(self.decode)} given)")
        for url in (*self.prefill, *self.decode):
            if not url.startswith(("http://", "https://")):
                raise SpecError("route", "url", url, "must start with http:// or https://")
        for side in self.sides:
            host, _, port = side.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise SpecError("route", "side", side, "must be HOST:PORT")
        for name in ("queue_timeout_s", "upstream_timeout_s", "connect_timeout_s",
                     "poll_interval_s"):
            if not getattr(self, name) > 0:
                raise SpecError("route", name, getattr(self, name), "must be > 0")
        for name, urls in (("prefill_nodes", self.prefill), ("decode_nodes", self.decode)):
            nodes = getattr(self, name)
            if nodes is not None and len(nodes) != len(urls):
                raise SpecError("route", name, len(nodes), f"one per instance ({len(urls)})")
        self.layout  # noqa: B018  (building it refuses a node named for both roles)

    @property
    def layout(self) -> Layout:
        """Which node each instance is on (`loads.Layout`)."""
        if self.prefill_nodes is None and self.decode_nodes is None:
            return Layout.one_per_node(len(self.prefill), len(self.decode))
        return Layout.of_names(self.prefill_nodes or tuple(self.prefill),
                               self.decode_nodes or tuple(self.decode))

    @property
    def model_name(self) -> str:
        return self.model or self.manifest.model

    @property
    def is_round_robin(self) -> bool:
        """Basic's "w/o scheduling", round robin over the instances: the mode's
        (`sched.mode.mode_preset`), as `policy.route_params` gives it."""
        return mode_preset(self.mode).is_round_robin

    def instances(self) -> Iterator[tuple[Role, int, str]]:
        for i, url in enumerate(self.prefill):
            yield Role.PREFILL, i, url
        for j, url in enumerate(self.decode):
            yield Role.DECODE, j, url

    def url_of(self, role: Role, index: int) -> str:
        return (self.prefill if role is Role.PREFILL else self.decode)[index]
