"""`QuotaScheduler`: vLLM's scheduler with a compute quota per step (paper §6.2), for prefill
instances: `--scheduler-cls dualpath.integrations.vllm.quota_scheduler.QuotaScheduler` with
the settings of `compute_quota.ComputeQuota` in `--additional-config`.

vLLM budgets a step by new tokens only (`max_num_batched_tokens`), so a step of a few agent
turns with long cached prefixes can run far longer than one of short fresh prompts. Here each
step's token budget is the packed batch of `sched.batching.pack_prefill_batch` over vLLM's own
order (running requests, then the waiting queues), each request a (cached, new) pair, its time
predicted by the profile's cost model: whole requests while the predicted time stays within the
quota, then the first that does not fit chunked to the largest size that does (binary search).
vLLM's scheduler then runs unchanged with that budget, and its first-come-first-served fill
gives exactly the packed batch: every request whole but the last, which gets what is left.

A waiting request's cached tokens are known only after the prefix-cache lookup and the
connector's answer, which vLLM's pass makes; the packing asks first and hands the connector's
answer to vLLM's pass (one question per request and step, as without the quota).

Invariant: a step's predicted time is within the quota, unless the head request's one token
alone exceeds it, or vLLM skips a packed request (blocked, out of KV blocks) and hands its
budget to the next one.

`quota_s` None measures only: vLLM's packing, the same step log. The step log (JSON lines)
has each step's pairs, predicted time and measured time (the time from the step's schedule,
or the previous step's end if later, to its output).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from dualpath.integrations.vllm.compute_quota import CONFIG_KEY, ComputeQuota
from dualpath.sched.batching import PrefillItem, pack_prefill_batch

MAX_UNFINISHED_STEPS = 16
"""Steps kept waiting for their output (vLLM has at most a few in flight)."""
Matched = tuple[int | None, bool]
"""The connector's answer: external tokens (None: unknown yet) and whether they load async."""


class QuotaScheduler(Scheduler):  # type: ignore[misc]
    """vLLM's `Scheduler` whose steps are packed under the compute quota. Under async
    scheduling it is an `AsyncQuotaScheduler` (vLLM's `AsyncScheduler` underneath)."""

    max_num_scheduled_tokens: int
    """vLLM's token budget of a step (set here for each step, then put back)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> QuotaScheduler:
        config = kwargs.get("vllm_config", args[0] if args else None)
        if cls is QuotaScheduler and config is not None \
                and config.scheduler_config.async_scheduling:
            cls = AsyncQuotaScheduler
        scheduler: QuotaScheduler = super().__new__(cls)
        return scheduler

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        quota = ComputeQuota.from_additional_config(self.vllm_config.additional_config)
        if quota is None:
            raise ValueError(f"QuotaScheduler needs --additional-config with {CONFIG_KEY!r} "
                             "(`dualpath vllm up --compute-quota MS --profile FILE` writes it)")
        self.quota = quota
        self.num_steps = 0
        self.num_over_quota = 0
        """Steps whose predicted time exceeded the quota (see the module's invariant)."""
        self._hits: dict[str, tuple[int, Matched]] = {}
        """This step's connector answers, asked by the packing, for vLLM's pass."""
        self._matched: Callable[[Request, int], Matched] | None = None
        if self.connector is not None and quota.quota_s is not None:
            self._matched = self.connector.get_num_new_matched_tokens
            self.connector.get_num_new_matched_tokens = self._answer  # type: ignore[method-assign]
        self._log: IO[str] | None = open(quota.step_log, "a", encoding="utf-8") \
            if quota.step_log else None  # noqa: SIM115 (open for the scheduler's life)
        if self._log is not None:
            self._log.write(json.dumps({"event": "init", "scheduler": type(self).__name__,
                                        "quota_s": quota.quota_s,
                                        "max_num_scheduled_tokens":
                                            self.max_num_scheduled_tokens}) + "\n")
        self._steps: dict[int, tuple[float, list[tuple[int, int]], float]] = {}
        """Scheduled, not yet finished steps: id(output) -> (scheduled at, pairs, predicted)."""
        self._last_output_at = 0.0

    # ---- packing -------------------------------------------------------------------------

    def _answer(self, request: Request, num_computed_tokens: int) -> Matched:
        memo = self._hits.pop(request.request_id, None)
        if memo is not None and memo[0] == num_computed_tokens:
            return memo[1]
        assert self._matched is not None
        return self._matched(request, num_computed_tokens)

    def _cached_tokens(self, request: Request) -> int | None:
        """A waiting request's tokens with KV before this step, as vLLM's pass will count
        them; None: it computes nothing this step (its KV loads asynchronously, or the
        connector cannot tell yet)."""
        if request.num_computed_tokens > 0:
            return int(request.num_computed_tokens)
        _, local, _, _ = self._get_local_prefix_cache_hit(request)
        if self._matched is None:
            return int(local)
        tail = local % self.block_size
        aligned = local - tail
        matched = self._matched(request, aligned)
        self._hits[request.request_id] = (aligned, matched)
        external, is_async = matched
        if external is None or (is_async and external > 0):
            return None
        if request.skip_reading_prefix_cache:
            external = 0
        if tail and external > tail:
            return int(aligned + external)
        return int(local if tail else local + external)

    def _queue(self) -> Iterator[PrefillItem]:
        """vLLM's order: the running requests, then the waiting queues (block holders
        first), up to the active-request limit; only requests with tokens to compute."""
        index = 0
        for request in self.running:
            remaining = (request.num_tokens_with_spec + request.num_output_placeholders
                         - request.num_computed_tokens)
            if remaining > 0:
                yield PrefillItem(index, request.num_computed_tokens, remaining)
                index += 1
        active = len(self.running) + self.num_waiting_for_streaming_input
        for queue in (self.kv_holding_waiting, self.waiting):
            for request in queue:
                if active >= self.max_num_active_reqs:
                    return
                if self._is_blocked_waiting_status(request.status):
                    continue
                cached = self._cached_tokens(request)
                if cached is None or cached >= request.num_tokens:
                    continue
                yield PrefillItem(index, cached, request.num_tokens - cached)
                index += 1
                active += 1

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        self._hits.clear()
        budget: int = self.max_num_scheduled_tokens
        if self.quota.quota_s is not None:
            batch = pack_prefill_batch(self._queue(), self.quota.quota_s, self.quota.costs,
                                       max_batch_tokens=budget)
            if batch.entries:  # nothing to compute: vLLM's pass still admits async loads
                self.max_num_scheduled_tokens = batch.num_new_tokens
        try:
            output = super().schedule(throttle_prefills)
        finally:
            self.max_num_scheduled_tokens = budget
        self._record(output)
        return output

    # ---- the step log --------------------------------------------------------------------

    def _record(self, output: SchedulerOutput) -> None:
        if not output.total_num_scheduled_tokens:
            return
        pairs = [(int(self.requests[r].num_computed_tokens) - n, n)
                 for r, n in output.num_scheduled_tokens.items() if r in self.requests]
        predicted = self.quota.predict_s(pairs)
        self.num_steps += 1
        if self.quota.quota_s is not None and predicted > self.quota.quota_s:
            self.num_over_quota += 1
        self._steps[id(output)] = (time.monotonic(), pairs, predicted)
        while len(self._steps) > MAX_UNFINISHED_STEPS:  # outputs vLLM never reported back
            del self._steps[next(iter(self._steps))]

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput
                           ) -> dict[int, EngineCoreOutputs]:
        outputs: dict[int, EngineCoreOutputs] = super().update_from_output(
            scheduler_output, model_runner_output)
        step = self._steps.pop(id(scheduler_output), None)
        if step is not None:
            now = time.monotonic()
            scheduled_at, pairs, predicted = step
            measured = now - max(scheduled_at, self._last_output_at)
            self._last_output_at = now
            if self._log is not None:
                self._log.write(json.dumps({
                    "t": round(time.time(), 4), "pairs": pairs,
                    "new_tokens": sum(n for _, n in pairs), "predicted_s": round(predicted, 5),
                    "measured_s": round(measured, 5), "quota_s": self.quota.quota_s}) + "\n")
                self._log.flush()
        return outputs

    def shutdown(self) -> None:
        super().shutdown()
        if self._log is not None:
            self._log.close()


class AsyncQuotaScheduler(QuotaScheduler, AsyncScheduler):  # type: ignore[misc]
    """`QuotaScheduler` over vLLM's `AsyncScheduler` (async scheduling on)."""
