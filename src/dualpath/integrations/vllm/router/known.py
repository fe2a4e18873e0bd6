"""Store files the router knows exist: a cache of positive answers in front of the store's
`contains` (a `stat` per file).

An agent's next turn repeats its whole context, so without it every request would check
every file of its prompt again; with it, only the files added since the agent's last turn
are checked. Only "stored" is remembered, for `ttl_s`: a file saved after a miss is found at
the next check, and a file evicted (or found corrupt and removed) is still counted for at
most `ttl_s`. Such a count is never wrong KV: the connector's load fails and vLLM recomputes
from that block (the prefill's `LoadReport` counts it as recomputed).
"""

from __future__ import annotations

import time
from collections.abc import Callable

TTL_S = 60.0
MAX_KEYS = 1 << 19
"""Files remembered at most (the oldest are forgotten first)."""
SLOW_CHECK_S = 50e-6
"""A store whose checks take longer than this on average is asked off the event loop."""


class KnownBlocks:
    """`contains` with positive answers remembered (see the module docstring)."""

    def __init__(self, contains: Callable[[bytes], bool], ttl_s: float = TTL_S,
                 max_keys: int = MAX_KEYS) -> None:
        self._contains = contains
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._known: dict[bytes, float] = {}
        """key -> when it was found stored; insertion order is age order."""
        self.num_checks = 0
        self.num_hits = 0
        self.check_s = 0.0
        """Time spent in the store's checks."""

    @property
    def is_slow(self) -> bool:
        """Whether the store's checks are slow enough to keep off the event loop."""
        return self.num_checks > 0 and self.check_s / self.num_checks > SLOW_CHECK_S

    def contains(self, key: bytes) -> bool:
        now = time.monotonic()
        found_at = self._known.get(key)
        if found_at is not None:
            if now - found_at < self.ttl_s:
                self.num_hits += 1
                return True
            self._known.pop(key, None)
        began = time.perf_counter()
        is_stored = self._contains(key)
        self.check_s += time.perf_counter() - began
        self.num_checks += 1
        if is_stored:
            if len(self._known) >= self.max_keys:
                self._known.pop(next(iter(self._known)), None)
            self._known[key] = now
        return is_stored

    def __len__(self) -> int:
        return len(self._known)
