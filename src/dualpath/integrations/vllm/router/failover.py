"""Failover: which instances are down, and a request placed again when one fails it.

An instance whose poll fails (refused, reset, timed out, not 200), or that refuses or drops a
request's connection, is marked down at once and takes no new requests
(`RoutePolicy.mark_down`); the first poll it answers brings it back. A request whose prefill
or decode instance fails it (unreachable, dropped, 5xx) before anything reached the client
is placed again from the start, `RETRIES` times, and up to `MAX_UNREACHED` more times after
instances it never reached (`RoutePolicy.requeue`: new instances, a new transfer id, a new
read plan; its KV is read from the store or recomputed, never taken from the failed
attempt). A stream that breaks after its first event ends with an error event and
`data: [DONE]`. `/health` says `degraded` while an instance is down, `unavailable` (503)
while every prefill or every decode instance is.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dualpath.http.api_error import ApiError
from dualpath.integrations.vllm.router.config import RouterConfig
from dualpath.integrations.vllm.router.policy import RoutePolicy
from dualpath.sched.types import Role

log = logging.getLogger("dualpath.route")

RETRIES = 1
"""Times a request failed by an instance before its first token is placed again."""
MAX_UNREACHED = 8
"""Times more a request is placed again after instances it never reached (no connection:
nothing was sent, so nothing ran twice), as when a whole node is gone and its other engines
are not yet marked down."""


@dataclass(frozen=True)
class Down:
    """Why and since when an instance is marked down."""

    reason: str
    since: float
    """`time.monotonic()` when it was marked."""


class Retry(Exception):
    """An instance failed the request before anything reached the client: place it again
    (`is_unreached`: the instance never got it)."""

    def __init__(self, error: ApiError, is_unreached: bool = False) -> None:
        super().__init__(error.message)
        self.error = error
        self.is_unreached = is_unreached


class Liveness:
    """The instances marked down, kept in step with the policy's candidates; `on_change` runs
    after each change (the router places the requests waiting)."""

    def __init__(self, cfg: RouterConfig, policy: RoutePolicy,
                 on_change: Callable[[], None]) -> None:
        self.cfg = cfg
        self.policy = policy
        self.on_change = on_change
        self.down: dict[tuple[Role, int], Down] = {}

    def mark_down(self, role: Role, index: int, reason: str) -> None:
        """The instance takes no new requests until a poll finds it answering again."""
        if (role, index) in self.down:
            return
        self.down[(role, index)] = Down(reason, time.monotonic())
        self.policy.mark_down(role, index)
        log.warning("%s instance %s is down (%s): no new requests until it answers again",
                    role.value, self.cfg.url_of(role, index), reason)
        self.on_change()

    def mark_up(self, role: Role, index: int, polled_at: float) -> None:
        """Back in service, unless it went down after this poll began (a poll in flight when a
        request found the instance dead may still have been answered by it)."""
        gone = self.down.get((role, index))
        if gone is None or gone.since >= polled_at:
            return
        del self.down[(role, index)]
        self.policy.mark_up(role, index)
        log.warning("%s instance %s is back after %.1f s", role.value,
                    self.cfg.url_of(role, index), time.monotonic() - gone.since)
        self.on_change()

    def health(self) -> tuple[str, list[dict[str, Any]]]:
        """("ok" | "degraded" | "unavailable", the instances down): unavailable while every
        prefill or every decode instance is down."""
        now = time.monotonic()
        down = [{"role": role.value, "url": self.cfg.url_of(role, i), "reason": d.reason,
                 "down_s": round(now - d.since, 1)} for (role, i), d in self.down.items()]
        if not down:
            return "ok", down
        roles = Counter(role for role, _ in self.down)
        if roles[Role.PREFILL] == len(self.cfg.prefill) or \
                roles[Role.DECODE] == len(self.cfg.decode):
            return "unavailable", down
        return "degraded", down
