"""Measure a running vLLM server's step costs over HTTP: what `dualpath profile --engine vllm`
writes to a profile (the same samples as `runtime.profiler` measures on the runtime's engines).

Every request is a `/v1/completions` call with a prompt of token ids (exact lengths, no
tokenizer), `ignore_eos`, temperature 0. The server must run with prefix caching (`start_server`
starts one so): a prompt's cached tokens are its prefix already in vLLM's KV cache, computed
by an earlier request, so a timed request computes only its new tokens while attending over
all of them, which is what a DualPath prefill does once the stored prefix is loaded.

- a prefill sample `(cached, new, batch)`: `batch` distinct prefixes of `cached` tokens are
  computed first (not timed); then `batch` requests of prefix + `new` fresh tokens, one output
  token each, are sent at once; the time until the last reply is one sample. The cached count
  recorded is the one vLLM reports (`vllm:prefix_cache_hits_total` per request: whole blocks).
- a decode sample `(batch, context)`: `batch` streamed requests of `context` prompt tokens and
  `DECODE_TOKENS` output tokens each, sent at once; the step time is the median gap between
  consecutive streamed tokens (each one decode step of the whole batch), at the mean context
  over those steps.

Both include the server's own per-request work (HTTP, detokenizing), as every real request
does. Each point is the median of `repeats` timings after one warm-up. Nothing is fitted here
(`dualpath.plan.step_profile` fits and writes the file). Torch-free: runs in `.venv`.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from dualpath.core.errors import DualPathError
from dualpath.core.step_grid import StepGrid
from dualpath.integrations.vllm.cluster.command import reaped_command
from dualpath.integrations.vllm.cluster.cpus import cpu_sets
from dualpath.integrations.vllm.cluster.ports import free_port

DECODE_TOKENS = 16
"""Output tokens of a decode sample's requests (15 step gaps each)."""


class VllmProfileError(DualPathError, RuntimeError):
    """A server that cannot be profiled (unreachable, no prefix caching, a failed request)."""


DEFAULT_VLLM_GRID = StepGrid(prefill_cached=(0, 512, 1536), prefill_new=(16, 128, 512),
                             prefill_batch=(1, 4), decode_batch=(1, 4, 8),
                             decode_context=(128, 512, 1024))
"""The default grid (docs/measurements.md has a run's length). Prefill points whose prompt does
not fit the server's `max_model_len` and decode points with a batch over its `max_num_seqs`
are skipped."""


QUICK_VLLM_GRID = StepGrid(prefill_cached=(0, 512), prefill_new=(16, 128),
                           prefill_batch=(1, 2), decode_batch=(1, 4),
                           decode_context=(128, 512), repeats=2)
"""A smaller grid, for tests and smoke runs."""


@dataclass
class ServerInfo:
    """What the server says about itself (`/v1/models`, `/metrics`)."""

    url: str
    model: str
    max_model_len: int
    block_size: int
    num_gpu_blocks: int


@dataclass
class VllmMeasurements:
    """Raw timings (seconds) of one vLLM server."""

    info: ServerInfo
    prefill: list[dict[str, float]] = field(default_factory=list)
    decode: list[dict[str, float]] = field(default_factory=list)


# -- HTTP ----------------------------------------------------------------------------------

def _get(url: str, timeout_s: float = 10.0) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            data: bytes = r.read()
            return data
    except (urllib.error.URLError, OSError) as e:
        raise VllmProfileError(f"{url}: {getattr(e, 'reason', e)}") from None


def _complete(base: str, model: str, prompt: Sequence[int], max_tokens: int,
              stream: bool = False, timeout_s: float = 600.0) -> list[float]:
    """Send one completion; the arrival times (perf_counter) of its streamed tokens, or of the
    reply when not streamed."""
    body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": stream}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    times: list[float] = []
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            if not stream:
                r.read()
                return [time.perf_counter()]
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                        times.append(time.perf_counter())
    except urllib.error.HTTPError as e:
        raise VllmProfileError(f"{base}: HTTP {e.code}: {e.read()[:300]!r}") from None
    except (urllib.error.URLError, OSError) as e:
        raise VllmProfileError(f"{base}: {getattr(e, 'reason', e)}") from None
    return times


def _all_at_once(calls: Sequence[Callable[[], list[float]]]) -> tuple[float, list[list[float]]]:
    """Run `calls` on threads started together: (start time, each call's result)."""
    out: list[list[float]] = [[] for _ in calls]
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return start, out


def _metric_samples(text: str, names: set[str]) -> Iterator[tuple[str, dict[str, str], float]]:
    wanted = "\n".join(line for line in text.splitlines()
                       if line.split("{", 1)[0].split(" ", 1)[0] in names)
    for family in text_string_to_metric_families(wanted + "\n" if wanted else ""):
        for s in family.samples:
            yield s.name, s.labels, s.value


def prefix_cache_hits(url: str) -> float:
    """`vllm:prefix_cache_hits_total` summed over the server's engines."""
    text = _get(url + "/metrics").decode()
    return sum(v for _, _, v in _metric_samples(text, {"vllm:prefix_cache_hits_total"}))


def server_info(url: str) -> ServerInfo:
    """The served model, its context limit and the KV cache (block size, blocks)."""
    models = json.loads(_get(url + "/v1/models"))
    if not models.get("data"):
        raise VllmProfileError(f"{url}/v1/models: no model served")
    m = models["data"][0]
    block_size = num_blocks = 0
    is_caching = None
    text = _get(url + "/metrics").decode()
    for name, labels, _ in _metric_samples(text, {"vllm:cache_config_info"}):
        if name == "vllm:cache_config_info":
            block_size = int(labels.get("block_size", "0") or 0)
            num_blocks = int(labels.get("num_gpu_blocks", "0") or 0)
            is_caching = labels.get("enable_prefix_caching")
    if not block_size or not num_blocks:
        raise VllmProfileError(f"{url}/metrics: no vllm:cache_config_info with block_size and "
                               "num_gpu_blocks (is this a vLLM server?)")
    if is_caching is not None and is_caching != "True":
        raise VllmProfileError(f"{url}: prefix caching is off; start the server with "
                               "--enable-prefix-caching (cached tokens are measured through it)")
    return ServerInfo(url, str(m["id"]), int(m.get("max_model_len") or 0), block_size,
                      num_blocks)


# -- measuring -----------------------------------------------------------------------------

def measure_server(url: str, grid: StepGrid, seed: int = 0,
                   on_point: Callable[[str], None] | None = None) -> VllmMeasurements:
    """Time the vLLM server at `url` over `grid`; `on_point(label)` after each point."""
    tick = on_point or (lambda _label: None)
    url = url.rstrip("/")
    info = server_info(url)
    out = VllmMeasurements(info)
    rng = np.random.default_rng(seed)
    # Token ids well inside any vocabulary, away from the special ones at either end.
    lo, hi = 1000, 30000

    def fresh(n: int) -> list[int]:
        return [int(x) for x in rng.integers(lo, hi, n)]

    model, cap = info.model, info.max_model_len or 2048
    _complete(url, model, fresh(32), 2)  # the server's first request pays one-off costs
    for cached in grid.prefill_cached:
        for batch in grid.prefill_batch:
            # One set of prefixes per (cached, batch), computed once: every repeat and every
            # new length hits them (their blocks stay in the cache, least recently used last).
            prefixes = [fresh(cached) for _ in range(batch)]
            if cached and cached + min(grid.prefill_new) + 1 <= cap:
                _all_at_once([lambda p=p: _complete(url, model, p, 1)  # type: ignore[misc]
                              for p in prefixes])
            for new in grid.prefill_new:
                if cached + new + 1 > cap:
                    tick("prefill (too long)")
                    continue
                times, hits = [], []
                for _ in range(grid.repeats + 1):
                    prompts = [p + fresh(new) for p in prefixes]
                    before = prefix_cache_hits(url)
                    start, ends = _all_at_once(
                        [lambda p=p: _complete(url, model, p, 1)  # type: ignore[misc]
                         for p in prompts])
                    times.append(max(e[-1] for e in ends) - start)
                    hits.append((prefix_cache_hits(url) - before) / batch)
                seconds = statistics.median(times[1:])
                hit = statistics.median(hits[1:])
                if cached and hit < 0.5 * cached:
                    raise VllmProfileError(
                        f"{url}: a prompt with {cached} tokens computed before hit only "
                        f"{hit:.0f} in vLLM's prefix cache (is prefix caching on, and the "
                        "KV cache large enough?)")
                out.prefill.append({"cached": hit, "new": cached + new - hit, "batch": batch,
                                    "seconds": seconds})
                tick(f"prefill c={cached} n={new} b={batch}")
    for batch in grid.decode_batch:
        for context in grid.decode_context:
            if context + DECODE_TOKENS > cap:
                tick("decode (too long)")
                continue
            # The same prompts every repeat, computed once before: a repeat's prefill is one
            # token each (the rest hits), so the streams are almost all decode steps.
            prompts = [fresh(context) for _ in range(batch)]
            _all_at_once([lambda p=p: _complete(url, model, p, 1)  # type: ignore[misc]
                          for p in prompts])
            steps = []
            for _ in range(grid.repeats + 1):
                _, streams = _all_at_once(
                    [lambda p=p: _complete(  # type: ignore[misc]
                        url, model, p, DECODE_TOKENS, stream=True) for p in prompts])
                # The first gap of each stream may hold another request's prefill; the rest
                # are decode steps of the whole batch.
                gaps = [b - a for s in streams for a, b in itertools.pairwise(s[1:])]
                if not gaps:
                    raise VllmProfileError(f"{url}: a streamed request returned "
                                           f"{max(len(s) for s in streams)} tokens, expected "
                                           f"{DECODE_TOKENS}")
                steps.append(statistics.median(gaps))
            out.decode.append({"batch": batch, "context": context + DECODE_TOKENS // 2,
                               "seconds": statistics.median(steps[1:])})
            tick(f"decode b={batch} ctx={context}")
    return out


# -- a server to profile -------------------------------------------------------------------

@dataclass(frozen=True)
class ServerArgs:
    """A plain vLLM server (no connector) for `dualpath profile --engine vllm` to start: the
    engine settings of the launcher's instances (`VllmClusterSpec` defaults), prefix caching
    on, on the cores one instance of a 1P1D cluster gets here."""

    model: str
    python: str
    dtype: str = "float32"
    max_model_len: int = 2048
    max_num_seqs: int = 8
    is_eager: bool = True
    kv_cache_gib: int = 1
    startup_timeout_s: float = 600.0

    def command(self, port: int) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", self.model, "--tokenizer", self.model, "--dtype", self.dtype,
                *(["--enforce-eager"] if self.is_eager else []), "--enable-prefix-caching",
                "--seed", "0", "--max-model-len", str(self.max_model_len),
                "--max-num-seqs", str(self.max_num_seqs), "--host", "127.0.0.1",
                "--port", str(port)]

    def engine(self) -> dict[str, Any]:
        """The `engine` settings a profile records (and `dualpath advise` deploys)."""
        return {"dtype": self.dtype, "max_model_len": self.max_model_len,
                "max_num_seqs": self.max_num_seqs, "enforce_eager": self.is_eager}


def instance_cores() -> list[int]:
    """The cores the launcher gives the first instance of a 1P1D cluster on this machine."""
    sets = cpu_sets(2, sorted(os.sched_getaffinity(0)))
    return sets[0] if sets else sorted(os.sched_getaffinity(0))


@contextmanager
def start_server(args: ServerArgs, log: Path) -> Iterator[str]:
    """A vLLM server on a free loopback port for the `with` block (its URL); its log in
    `log`. The server runs under a reaper, so nothing of it outlives the block."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
           "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, instance_cores()))}
    env.pop("OMP_NUM_THREADS", None)
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            reaped_command(args.command(port), f"dp{os.getpid()}.profile", 10.0),
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + args.startup_timeout_s
            while True:
                if proc.poll() is not None:
                    tail = log.read_text(errors="replace").splitlines()[-20:]
                    raise VllmProfileError(f"the vLLM server exited with {proc.returncode} "
                                           f"(log {log}):\n" + "\n".join(tail))
                try:
                    _get(url + "/health", 5.0)
                    break
                except VllmProfileError:
                    if time.monotonic() > deadline:
                        raise VllmProfileError(f"the vLLM server was not healthy after "
                                               f"{args.startup_timeout_s:.0f} s (log {log})"
                                               ) from None
                    time.sleep(1.0)
            yield url
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
