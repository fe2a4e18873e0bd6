"""The compute quota of a vLLM prefill instance (paper §6.2), as settings that travel to the
engine: the launcher writes them into vLLM's `--additional-config`, and `quota_scheduler`
reads them back inside the engine. No vllm import (the launcher runs without it).

A step's time is predicted from its requests' (cached, new) token pairs with a
`dualpath profile` profile's prefill cost model (`sched.profiled.ProfiledCosts`); the packing
rule is `sched.batching.pack_prefill_batch`, the one the simulator and the runtime use.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from dualpath.core.errors import SpecError
from dualpath.core.validate import positive
from dualpath.sched.profiled import ProfiledCosts

CONFIG_KEY = "dualpath_compute_quota"
"""The key of these settings in vLLM's `additional_config`."""
SCHEDULER_CLS = "dualpath.integrations.vllm.quota_scheduler.QuotaScheduler"
"""What `--scheduler-cls` names."""
_COST_FIELDS = tuple(f.name for f in fields(ProfiledCosts) if f.name != "source")


@dataclass(frozen=True)
class ComputeQuota:
    """Frozen, validated. `quota_s` None: vLLM's own packing, only measured (`step_log`)."""

    costs: ProfiledCosts
    """The engine's step cost model (a profile of this model on this hardware)."""
    quota_s: float | None = None
    """The most predicted time a step may take (one token of the head request always runs)."""
    step_log: str | None = None
    """A JSON-lines file: one line per step with its pairs, predicted and measured times."""

    def __post_init__(self) -> None:
        if self.quota_s is not None:
            positive("compute_quota", "quota_s", self.quota_s)

    def predict_s(self, pairs: list[tuple[int, int]]) -> float:
        """Predicted time of a step over `(cached, new)` pairs."""
        return self.costs.prefill_pass_time_s(pairs)

    def additional_config(self) -> dict[str, Any]:
        """vLLM's `additional_config` entry that carries these settings."""
        costs = asdict(self.costs)
        return {CONFIG_KEY: {"quota_s": self.quota_s, "step_log": self.step_log,
                             "costs": costs}}

    def server_args(self) -> list[str]:
        """The vLLM server arguments that turn it on."""
        return ["--scheduler-cls", SCHEDULER_CLS,
                "--additional-config", json.dumps(self.additional_config())]

    @classmethod
    def from_additional_config(cls, config: Mapping[str, Any] | Any) -> ComputeQuota | None:
        """The settings in vLLM's `additional_config` (None: not there); a bad entry raises a
        `SpecError` naming it."""
        if not isinstance(config, Mapping) or CONFIG_KEY not in config:
            return None
        entry = config[CONFIG_KEY]
        owner = f"additional_config.{CONFIG_KEY}"
        if not isinstance(entry, Mapping):
            raise SpecError("additional_config", CONFIG_KEY, entry, "must be an object")
        raw = entry.get("costs")
        if not isinstance(raw, Mapping):
            raise SpecError(owner, "costs", raw, "must be an object of ProfiledCosts fields")
        missing = [n for n in _COST_FIELDS if n not in raw]
        if missing:
            raise SpecError(owner, "costs", sorted(raw), f"lacks {', '.join(missing)}")
        try:
            costs = ProfiledCosts(**{n: float(raw[n]) for n in _COST_FIELDS},
                                  source=str(raw.get("source", "")))
        except (TypeError, ValueError) as e:
            raise SpecError(owner, "costs", dict(raw), str(e)) from None
        quota = entry.get("quota_s")
        log = entry.get("step_log")
        return cls(costs=costs, quota_s=None if quota is None else float(quota),
                   step_log=None if log is None else str(log))
