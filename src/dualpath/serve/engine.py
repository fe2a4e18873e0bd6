"""A served cluster: the runtime's `Cluster` behind a thread-safe `generate`.

`ServingEngine` starts an emulated cluster (`runtime.Cluster`: the scheduler and the nodes as
processes or threads) and one dispatcher thread, the cluster's only reader: it routes each
`TurnTokens` / `TurnDone` to the `Generation` of its request. Any number of threads (the HTTP
server's, one per connection) submit requests concurrently; the cluster's scheduler batches
them exactly as it batches replayed agent turns, so a follow-up turn whose prompt extends an
earlier one reads the earlier turn's persisted KV blocks from storage, on whichever path the
scheduler picks.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, replace

from dualpath.core.errors import DualPathError
from dualpath.runtime.emulated_cluster import Cluster, RunError
from dualpath.runtime.messages import TurnDone, TurnTokens
from dualpath.runtime.model.sampling import SamplingParams, TokenLogprobs
from dualpath.runtime.model.tokenizer import Tokenizer
from dualpath.runtime.run_config import RunConfig

STATS_INTERVAL_S = 1.0
"""How often the served cluster's nodes report their counters."""


class ServeError(DualPathError):
    """The cluster cannot serve (it failed and is restarting or out of restarts, is closed, or a
    request timed out)."""


@dataclass(frozen=True)
class GenerateRequest:
    """One generation: prompt token ids and sampling (`sampling.seed` None: derived per
    request); streaming requests report their tokens per decode step."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    is_streaming: bool = False


@dataclass(frozen=True)
class Finished:
    """A finished generation. `output_ids` excludes a final EOS or stop token
    (`finish_reason` "stop"); "length" means it reached `max_tokens`, "cancelled" that
    `cancel` ended it first. `logprobs` (when asked for) match `output_ids` one to one."""

    output_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens whose KV was read from storage instead of computed."""
    ttft_s: float
    total_s: float
    logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass
class Generation:
    """One request in flight: `chunks()` (or `achunks()` in an event loop) yields new token
    ids as the cluster reports them (streaming requests get them per decode step, others all
    at the end), `result()` waits for the end; `logprobs` grows with the ids yielded."""

    request_id: int
    prompt_tokens: int
    cached_tokens: int
    eos_token_ids: tuple[int, ...]
    sampling: SamplingParams
    timeout_s: float
    _cancel: Callable[[int], None]
    submitted_at: float = field(default_factory=time.time)
    is_cancelled: bool = False
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    first_token_at: float | None = None
    """When the dispatcher got its first token (streaming requests; else at the end)."""
    _events: queue.Queue[TurnTokens | TurnDone | BaseException] = field(
        default_factory=queue.Queue
    )
    _wake: Callable[[], None] | None = None
    _num_yielded: int = 0
    _result: Finished | None = None

    def _put(self, event: TurnTokens | TurnDone | BaseException) -> None:
        if self.first_token_at is None and not isinstance(event, BaseException):
            self.first_token_at = time.time()
        self._events.put(event)
        wake = self._wake
        if wake is not None:
            wake()

    def chunks(self) -> Iterator[tuple[int, ...]]:
        """New output token ids, chunk by chunk, until the request finishes (a final EOS or
        stop token is not yielded); ServeError if the cluster fails or `timeout_s` passes."""
        deadline = self.submitted_at + self.timeout_s
        while self._result is None:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                raise self._timed_out() from None
            ids = self._take(event)
            if ids:
                yield ids

    async def achunks(self) -> AsyncIterator[tuple[int, ...]]:
        """`chunks` for an asyncio event loop: waits without holding a thread."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(ready.set)

        self._wake = wake
        deadline = self.submitted_at + self.timeout_s
        while self._result is None:
            ready.clear()  # before the check: an event put after it sets it again
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                try:
                    await asyncio.wait_for(ready.wait(), max(0.0, deadline - time.time()))
                except TimeoutError:
                    raise self._timed_out() from None
                continue
            ids = self._take(event)
            if ids:
                yield ids

    def _timed_out(self) -> ServeError:
        self.cancel()  # nobody waits for it any more
        return ServeError(f"request {self.request_id}: no result within {self.timeout_s:g} s")

    def _take(self, event: TurnTokens | TurnDone | BaseException) -> tuple[int, ...]:
        """The ids `event` adds to what was yielded (its logprobs appended)."""
        if isinstance(event, BaseException):
            raise ServeError(f"request {self.request_id}: {event}") from event
        if isinstance(event, TurnTokens):
            ids, lps = event.token_ids, event.logprobs
        else:
            self._result = self._finish(event)
            ids = self._result.output_ids[self._num_yielded:]
            lps = self._result.logprobs[self._num_yielded:]
        ids = self._strip_eos(ids)
        self.logprobs.extend(lps[:len(ids)])
        self._num_yielded += len(ids)
        return ids

    def cancel(self) -> None:
        """Ask the cluster to end this request at its next decode step (its result then
        has the tokens so far and `finish_reason` "cancelled"); harmless once finished."""
        if not self.is_cancelled and self._result is None:
            self.is_cancelled = True
            self._cancel(self.request_id)

    def result(self) -> Finished:
        """Wait for the end (see `chunks`)."""
        for _ in self.chunks():
            pass
        assert self._result is not None
        return self._result

    def _strip_eos(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        # Only an output's last token can stop it.
        if ids and self.sampling.stops_at(ids[-1], self.eos_token_ids):
            return ids[:-1]
        return ids

    def _finish(self, done: TurnDone) -> Finished:
        out, lps = done.output_ids, done.logprobs
        is_eos = bool(out) and self.sampling.stops_at(out[-1], self.eos_token_ids)
        reason = "stop" if is_eos else "length"
        if self.is_cancelled and not is_eos and len(out) < self.sampling.max_tokens:
            reason = "cancelled"
        return Finished(
            output_ids=out[:-1] if is_eos else out,
            finish_reason=reason,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            ttft_s=max(0.0, done.first_token_at - self.submitted_at),
            total_s=max(0.0, done.done_at - self.submitted_at),
            logprobs=lps[:-1] if is_eos and len(lps) == len(out) else lps,
        )


class RestartBudget:
    """At most `max_restarts` restarts within any `window_s` seconds (a sliding window).

    A server that fails now and then, hours apart, keeps restarting; one that fails over and
    over (a fault that a restart does not cure) runs out and stays failed, saying so.
    """

    def __init__(self, max_restarts: int, window_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._clock = clock
        self._taken_at: deque[float] = deque()

    def num_in_window(self) -> int:
        """Restarts taken within the last `window_s` seconds."""
        now = self._clock()
        while self._taken_at and now - self._taken_at[0] >= self.window_s:
            self._taken_at.popleft()
        return len(self._taken_at)

    def try_take(self) -> bool:
        """Take one restart if the window has one left."""
        if self.num_in_window() >= self.max_restarts:
            return False
        self._taken_at.append(self._clock())
        return True


@dataclass
class ServeStats:
    """Counters since start (what `GET /stats` reports)."""

    num_requests: int = 0
    num_finished: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0


class ServingEngine:
    """The cluster, a tokenizer, and the dispatcher thread; `close()` stops them all."""

    def __init__(self, cfg: RunConfig, tokenizer: Tokenizer, model_name: str,
                 request_timeout_s: float = 600.0, max_restarts: int = 3,
                 log: Callable[[str], object] | None = None,
                 restart_window_s: float = 3600.0) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.request_timeout_s = request_timeout_s
        self.restarts = RestartBudget(max_restarts, restart_window_s)
        """After a node or the scheduler fails, start a new cluster on the same store (its
        persisted KV is kept), at most `max_restarts` times within any `restart_window_s`;
        past that the server stays failed."""
        self.num_restarts = 0
        """Restarts over the server's life."""
        self._num_unpersisted_before = 0
        """Blocks earlier (failed) clusters could not persist."""
        self._num_unpersisted_warned = 0
        self._next_unpersisted_warning_at = 0.0
        self._log = log or (lambda _m: None)
        if cfg.stats_interval_s is None:  # live node counters, for /metrics
            cfg = self.cfg = replace(cfg, stats_interval_s=STATS_INTERVAL_S)
        self.cluster = Cluster(cfg)
        if tokenizer.vocab_size > self.cluster.vocab_size:
            self.cluster.close()
            raise ServeError(f"the tokenizer has {tokenizer.vocab_size} ids, the model only "
                             f"{self.cluster.vocab_size}")
        self.stats = ServeStats()
        self.started_at = time.time()
        self._pending: dict[int, Generation] = {}
        self._lock = threading.Lock()
        self._failure: BaseException | None = None
        self._is_stopping = threading.Event()
        self._is_closed = False
        self._is_restarting = False
        self._thread = threading.Thread(target=self._dispatch, name="dualpath-dispatch",
                                        daemon=True)
        self._thread.start()

    @property
    def max_sequence_tokens(self) -> int:
        return self.cluster.max_sequence_tokens

    @property
    def max_prompt_tokens(self) -> int:
        return self.cluster.max_prompt_tokens

    def num_in_flight(self) -> tuple[int, int]:
        """(waiting, running): requests with no token out yet (queued or in prefill), and
        those decoding."""
        with self._lock:
            gens = list(self._pending.values())
        running = sum(1 for g in gens if g.first_token_at is not None)
        return len(gens) - running, running

    @property
    def num_unpersisted_blocks(self) -> int:
        """KV blocks the cluster (and any it replaced) could not persist (a full disk, a
        read-only store); each is a later cache miss."""
        return self._num_unpersisted_before + self.cluster.num_unpersisted_blocks

    @property
    def is_healthy(self) -> bool:
        return self._failure is None and not self._is_stopping.is_set()

    def generate(self, req: GenerateRequest) -> Generation:
        """Submit `req`; SpecError names a field the cluster cannot serve, ServeError says
        why the cluster cannot serve at all."""
        # Registered under the lock the dispatcher routes (and fails requests) under: a result
        # cannot arrive first, and a failure cannot slip between the check and the register.
        with self._lock:
            if self._is_stopping.is_set():
                raise ServeError("the server is shutting down")
            if self._failure is not None:
                again = " (restarting)" if self._is_restarting else ""
                raise ServeError(f"the cluster failed: {self._failure}{again}")
            rid, hit = self.cluster.submit(req.prompt_ids, req.sampling, req.is_streaming)
            gen = Generation(rid, len(req.prompt_ids), hit, self.tokenizer.eos_token_ids,
                             req.sampling, self.request_timeout_s, self.cluster.cancel)
            self._pending[rid] = gen
            self.stats.num_requests += 1
            self.stats.num_prompt_tokens += len(req.prompt_ids)
            self.stats.num_cached_tokens += hit
        return gen

    def _dispatch(self) -> None:
        while not self._is_stopping.is_set():
            try:
                msg = self.cluster.next_message(0.2)
            except RunError as exc:
                self._fail(exc)
                if not self._restart(exc):
                    return
                continue
            self._warn_if_unpersisted()
            if msg is None:
                continue
            with self._lock:
                gen = self._pending.get(msg.request_id)
                if isinstance(msg, TurnDone):
                    self._pending.pop(msg.request_id, None)
                    self.stats.num_finished += 1
                    self.stats.num_generated_tokens += len(msg.output_ids)
            if gen is not None:
                gen._put(msg)

    def _warn_if_unpersisted(self) -> None:
        """Log when more blocks went unpersisted, at most once a minute (the nodes print
        why). Checked before each message is routed, so a request whose blocks failed to
        persist finishes after the warning."""
        n = self.num_unpersisted_blocks
        now = time.monotonic()
        if n > self._num_unpersisted_warned and now >= self._next_unpersisted_warning_at:
            self._num_unpersisted_warned = n
            self._next_unpersisted_warning_at = now + 60.0
            self._log(f"warning: {n} KV blocks could not be persisted so far (storage writes "
                      "fail); serving goes on, later requests recompute them")

    def _restart(self, exc: BaseException) -> bool:
        """A new cluster on the same store in place of a failed one (the requests in flight
        have failed); False when the window has no restart left or the server is stopping."""
        budget = self.restarts
        if self._is_stopping.is_set():
            self._log(f"cluster failed: {exc}; not restarting (the server is stopping)")
            return False
        if not budget.try_take():
            self._log(f"cluster failed: {exc}; not restarting ({budget.max_restarts} restarts "
                      f"within {budget.window_s:g} s used)")
            return False
        self.num_restarts += 1
        self._is_restarting = True
        self._log(f"cluster failed: {exc}; restarting ({budget.num_in_window()} of "
                  f"{budget.max_restarts}) on the same store (at most {budget.max_restarts} "
                  f"per {budget.window_s:g} s)")
        self.cluster.close()
        if self._is_stopping.is_set():
            return False
        try:
            cluster = Cluster(self.cfg)
        except Exception as start_exc:  # the server stays failed, and says why
            self._log(f"restart failed: {start_exc}")
            with self._lock:
                self._failure = start_exc
                self._is_restarting = False
            return False
        with self._lock:
            if not self._is_stopping.is_set():
                # The old cluster's count moves into the total as it is replaced: the
                # counter never counts a cluster twice, nor goes down.
                self._num_unpersisted_before += self.cluster.num_unpersisted_blocks
                self.cluster, cluster = cluster, self.cluster
                self._failure = None
                self._is_restarting = False
        # The failed cluster, closed already, or the new one if a stop came meanwhile.
        cluster.close()
        if self._is_stopping.is_set():
            return False
        self._log("cluster restarted")
        return True

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self._failure = exc
            pending, self._pending = self._pending, {}
        for gen in pending.values():
            gen._put(exc)

    def begin_stop(self) -> None:
        """Refuse new requests and never restart from now on (safe in a signal handler: a
        Ctrl-C reaches the node processes too, and their deaths must not start a new
        cluster)."""
        self._is_stopping.set()

    def close(self) -> None:
        """Stop the dispatcher, fail what is still in flight, stop the cluster."""
        if self._is_closed:
            return
        self._is_closed = True
        self._is_stopping.set()
        self._thread.join(timeout=330.0)  # a restart in progress finishes starting first
        self._fail(ServeError("the server shut down"))
        self.cluster.close()

    def __enter__(self) -> ServingEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
