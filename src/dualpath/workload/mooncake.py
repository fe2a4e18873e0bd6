"""Mooncake-format request traces (kvcache-ai/Mooncake FAST'25 release; also read by AIPerf/Dynamo).

One JSON object per line, exactly these fields::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

- `timestamp`: arrival time in milliseconds since the trace start (number >= 0);
- `input_length`, `output_length`: token counts (integers >= 1);
- `hash_ids`: remapped prefix-block hashes, one per 512-token block of the input
  (`len(hash_ids) == ceil(input_length / 512)`); equal ids mean a reusable block.

`load_mooncake` is strict and all-or-nothing like the trajectory loader. Replay is in timestamp
order (stable for ties). Hits are computed incrementally against an unbounded store: a request
hits its longest prefix of blocks that any earlier request stored, and then stores all of its
blocks (the prefill writes them). Hit tokens are capped at the input length, since the last block
may be partial.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np

from dualpath.core.blocks import longest_prefix
from dualpath.workload.jsonl import EMPTY, TrajectoryFile, parse_json_line, trajectory_file
from dualpath.workload.trace_errors import TraceFormatError
from dualpath.workload.trajectory import FloatArray, IntArray, Trajectory

MOONCAKE_BLOCK_SIZE = 512
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True, slots=True)
class MooncakeRequest:
    """One request of a Mooncake trace (times in seconds, lengths in tokens)."""

    timestamp_s: float
    input_length_tokens: int
    output_length_tokens: int
    hash_ids: tuple[int, ...]


class PrefixStore:
    """An unbounded store of block ids; `lookup_then_store` is one request's visit."""

    def __init__(self) -> None:
        self._stored: set[int] = set()

    def __len__(self) -> int:
        return len(self._stored)

    def lookup_then_store(self, hash_ids: Sequence[int]) -> int:
        """Number of leading blocks already stored (the hit, in blocks); then store them all."""
        hit = longest_prefix(hash_ids, self._stored.__contains__)  # type: ignore[arg-type]
        self._stored.update(hash_ids)
        return hit


@dataclass(frozen=True, slots=True, eq=False)
class MooncakeTrace:
    """A loaded Mooncake trace, requests in replay (timestamp) order, with per-request arrays.

    `hit_blocks[r]` and `hit_tokens[r]` are request r's prefix hit against an unbounded store
    that holds every block of requests 0..r-1.
    """

    requests: tuple[MooncakeRequest, ...]
    hit_blocks: IntArray
    block_size_tokens: int = MOONCAKE_BLOCK_SIZE

    @classmethod
    def from_requests(
        cls, requests: Iterable[MooncakeRequest], block_size_tokens: int = MOONCAKE_BLOCK_SIZE
    ) -> MooncakeTrace:
        """Sort by timestamp (stable) and compute every request's hit incrementally."""
        ordered = tuple(sorted(requests, key=lambda r: r.timestamp_s))
        store = PrefixStore()
        hits = np.fromiter((store.lookup_then_store(r.hash_ids) for r in ordered), np.int64,
                           len(ordered))
        return cls(ordered, hits, block_size_tokens)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def timestamp_s(self) -> FloatArray:
        return np.fromiter((r.timestamp_s for r in self.requests), np.float64, self.num_requests)

    @property
    def input_tokens(self) -> IntArray:
        return np.fromiter((r.input_length_tokens for r in self.requests), np.int64,
                           self.num_requests)

    @property
    def output_tokens(self) -> IntArray:
        return np.fromiter((r.output_length_tokens for r in self.requests), np.int64,
                           self.num_requests)

    @property
    def num_blocks(self) -> IntArray:
        return np.fromiter((len(r.hash_ids) for r in self.requests), np.int64, self.num_requests)

    @property
    def hit_tokens(self) -> IntArray:
        return np.minimum(self.hit_blocks * self.block_size_tokens, self.input_tokens)

    @property
    def block_reuse_rate(self) -> float:
        """Fraction of all requests' blocks that an unbounded cache serves (0.37 for Kimi's)."""
        return float(self.hit_blocks.sum()) / max(1, int(self.num_blocks.sum()))

    @property
    def token_hit_rate(self) -> float:
        """Fraction of all input tokens served from the unbounded cache."""
        return float(self.hit_tokens.sum()) / max(1, int(self.input_tokens.sum()))


def parse_mooncake(
    lines: Iterable[str], path: str = "<input>", block_size_tokens: int = MOONCAKE_BLOCK_SIZE
) -> MooncakeTrace:
    """Parse Mooncake lines (blank lines skipped). All or nothing; errors name `path:line`
    (a file of blank lines: `path: empty`)."""
    requests: list[MooncakeRequest] = []
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        obj = parse_json_line(path, lineno, raw)
        unknown = sorted(set(obj) - set(_FIELDS))
        if unknown:
            raise TraceFormatError(path, lineno, f"unknown field; valid: {list(_FIELDS)}",
                                   unknown[0])
        for name in _FIELDS:
            if name not in obj:
                raise TraceFormatError(path, lineno, "missing", name)
        ts = obj["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) \
                or ts < 0:
            raise TraceFormatError(path, lineno, f"must be a number of ms >= 0, got {ts!r}",
                                   "timestamp")
        lengths = []
        for name in ("input_length", "output_length"):
            v = obj[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise TraceFormatError(path, lineno, f"must be an integer >= 1, got {v!r}", name)
            lengths.append(v)
        ids = obj["hash_ids"]
        if not isinstance(ids, list) or not all(type(h) is int for h in ids) or (
            ids and min(ids) < 0
        ):
            raise TraceFormatError(path, lineno, "must be a list of integers >= 0", "hash_ids")
        want = -(-lengths[0] // block_size_tokens)
        if len(ids) != want:
            raise TraceFormatError(
                path, lineno, f"has {len(ids)} ids but input_length {lengths[0]} needs "
                f"ceil({lengths[0]}/{block_size_tokens}) = {want}", "hash_ids",
            )
        requests.append(MooncakeRequest(ts / 1000.0, lengths[0], lengths[1], tuple(ids)))
    if not requests:
        raise TraceFormatError(path, 0, EMPTY)
    return MooncakeTrace.from_requests(requests, block_size_tokens)


def load_mooncake(path: str | Path, block_size_tokens: int = MOONCAKE_BLOCK_SIZE) -> MooncakeTrace:
    """Load and validate a Mooncake-format JSONL trace (see the module docstring)."""
    p = str(path)
    try:
        with open(p, encoding="utf-8") as f:
            return parse_mooncake(f, p, block_size_tokens)
    except OSError as exc:
        raise TraceFormatError(p, 0, f"cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise TraceFormatError(p, 0, f"not UTF-8 text: {exc.reason}") from None


def to_trajectories(trace: MooncakeTrace, source: str = "") -> TrajectoryFile:
    """Chain a trace's requests into trajectories where the trajectory model applies.

    Request r continues the open trajectory whose last request p it extends: r's hash ids start
    with all of p's full-block ids, and r's input holds p's prompt and output plus at least one
    new token (`input_r >= input_p + output_p + 1`). Then turn r appends
    `input_r - input_p - output_p` tokens and p's turn generated `output_p`. Any other request
    starts a new trajectory with `A_1 = input_length`. A trajectory continues at most once from a
    given request (a later branch from the same request starts afresh).

    What is lost: arrival times (trajectories replay back to back) and reuse across
    trajectories (a shared system prompt is stored once in the trace, but our hits are only
    within a trajectory), so the converted hit rate is a lower bound of the trace's.
    """
    bs = trace.block_size_tokens
    tails: dict[tuple[int, ...], int] = {}  # full-block ids of a chain's last request -> chain
    chains: list[list[MooncakeRequest]] = []
    for r in trace.requests:
        ids = r.hash_ids
        chain = -1
        for k in range(len(ids), 0, -1):
            c = tails.get(ids[:k])
            if c is None:
                continue
            p = chains[c][-1]
            if r.input_length_tokens >= p.input_length_tokens + p.output_length_tokens + 1:
                chain = c
                del tails[ids[:k]]
            break
        if chain < 0:
            chain = len(chains)
            chains.append([])
        chains[chain].append(r)
        full = ids[: r.input_length_tokens // bs]
        if full:
            tails[full] = chain
    trajectories = []
    for c, reqs in enumerate(chains):
        append = [reqs[0].input_length_tokens]
        append += [
            b.input_length_tokens - a.input_length_tokens - a.output_length_tokens
            for a, b in pairwise(reqs)
        ]
        trajectories.append(Trajectory(tuple(append),
                                       tuple(r.output_length_tokens for r in reqs), f"mc-{c}"))
    return trajectory_file(
        trajectories, None, meta={
            "converted_from": "mooncake", "source": source,
            "num_requests": trace.num_requests, "num_trajectories": len(trajectories),
        },
    )
