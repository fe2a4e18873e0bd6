"""The step shapes an engine profiler times (`dualpath profile`), one type for every engine it
profiles (our runtime's, a vLLM server): prefill passes over every (cached, new, batch),
decode steps over every (batch, context); each engine skips the points it cannot run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class StepGrid:
    prefill_cached: tuple[int, ...]
    prefill_new: tuple[int, ...]
    prefill_batch: tuple[int, ...]
    decode_batch: tuple[int, ...]
    decode_context: tuple[int, ...]
    repeats: int = 3
    """Timed runs per point (their median is kept)."""

    @property
    def num_steps(self) -> int:
        """Prefill and decode points (each counts once in a progress bar, run or skipped)."""
        return (len(self.prefill_cached) * len(self.prefill_new) * len(self.prefill_batch)
                + len(self.decode_batch) * len(self.decode_context))

    def with_repeats(self, repeats: int) -> StepGrid:
        return dataclasses.replace(self, repeats=repeats)
