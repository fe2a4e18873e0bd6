"""The trajectory JSONL format, version 1, and its strict loader.

A file is UTF-8 JSON Lines. Line 1 is a header object; every following non-blank line is one
trajectory object. No other fields are allowed in either (typos fail loudly).

Header (line 1)::

    {"format": "dualpath-trajectories", "version": 1, "max_len_tokens": 65536,
     "block_size_tokens": 64, "meta": {...}}

- `format` (required): exactly "dualpath-trajectories".
- `version` (required): 1.
- `max_len_tokens` (optional, int >= 1 or null): the MaxLen every trajectory respects
  (each trajectory's total, sum of A_i + g_i, is at most this). Checked on load.
- `block_size_tokens` (optional, int >= 1, default 64): the KV block size hits are aligned to.
- `meta` (optional, object): free-form provenance (generator preset, seed, parameters, source).

Trajectory line::

    {"id": "64k-0", "append_tokens": [5120, 311, ...], "gen_tokens": [96, 180, ...]}

- `id` (required, string): unique within the file.
- `append_tokens` (required): A_i per turn, integers >= 1.
- `gen_tokens` (required): g_i per turn, integers >= 1, same count as `append_tokens`.

The loader reads the whole file before returning anything: either every trajectory is valid and
returned, or a `TraceFormatError` names the file, the line and the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from dualpath.core.blocks import DEFAULT_BLOCK_SIZE
from dualpath.core.errors import SpecError
from dualpath.workload.trace_errors import TraceFormatError
from dualpath.workload.trajectory import Trajectory

FORMAT_NAME = "dualpath-trajectories"
FORMAT_VERSION = 1
_HEADER_FIELDS = {"format", "version", "max_len_tokens", "block_size_tokens", "meta"}
_TRAJ_FIELDS = ("id", "append_tokens", "gen_tokens")
EMPTY = "empty"
"""Why a file with no line but blank ones is refused, by every trace reader alike."""


@dataclass(frozen=True, slots=True)
class TrajectoryFile:
    """A loaded (or to-be-written) trajectory file: header fields plus trajectories."""

    trajectories: tuple[Trajectory, ...]
    max_len_tokens: int | None = None
    block_size_tokens: int = DEFAULT_BLOCK_SIZE
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_len_tokens is not None:
            for t in self.trajectories:
                if t.total_tokens > self.max_len_tokens:
                    raise SpecError(
                        "TrajectoryFile", "max_len_tokens", self.max_len_tokens,
                        f"trajectory {t.trajectory_id!r} has {t.total_tokens} tokens",
                    )

    def header(self) -> dict[str, Any]:
        """The header object written on line 1."""
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "max_len_tokens": self.max_len_tokens,
            "block_size_tokens": self.block_size_tokens,
            "meta": self.meta,
        }


def write_trajectories(out: TextIO, tf: TrajectoryFile) -> None:
    """Write `tf` as format version 1 to an open text stream."""
    out.write(json.dumps(tf.header(), separators=(",", ":")) + "\n")
    for t in tf.trajectories:
        out.write(
            json.dumps(
                {"id": t.trajectory_id, "append_tokens": t.append_tokens,
                 "gen_tokens": t.gen_tokens},
                separators=(",", ":"),
            )
            + "\n"
        )


def save_trajectories(path: str | Path, tf: TrajectoryFile) -> None:
    """Write `tf` to `path` (created or replaced)."""
    with open(path, "w", encoding="utf-8") as f:
        write_trajectories(f, tf)


def _int_field(path: str, lineno: int, name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceFormatError(path, lineno, f"must be an integer >= {minimum}, got {value!r}",
                               name)
    return int(value)


def _lengths(path: str, lineno: int, name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise TraceFormatError(path, lineno, f"must be a non-empty list of integers, "
                               f"got {type(value).__name__}", name)
    if all(type(v) is int for v in value) and min(value) >= 1:  # fast path; bool is not int
        return tuple(value)
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TraceFormatError(path, lineno, f"turn {i}: must be an integer >= 1, got {v!r}",
                                   name)
    return tuple(value)


def parse_json_line(path: str, lineno: int, text: str) -> dict[str, Any]:
    """One JSON object from one line, or a TraceFormatError naming the line."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(path, lineno, f"invalid JSON: {exc.msg} (column {exc.colno})"
                               ) from None
    except RecursionError:  # the C parser recurses per nesting level
        raise TraceFormatError(path, lineno, "too deeply nested") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _parse_header(path: str, obj: dict[str, Any]) -> tuple[int | None, int, dict[str, Any]]:
    if obj.get("format") != FORMAT_NAME:
        raise TraceFormatError(path, 1, f"expected {FORMAT_NAME!r} (the header line)", "format")
    unknown = sorted(set(obj) - _HEADER_FIELDS)
    if unknown:
        raise TraceFormatError(path, 1, f"unknown field; valid: {sorted(_HEADER_FIELDS)}",
                               unknown[0])
    if obj.get("version") != FORMAT_VERSION:
        raise TraceFormatError(path, 1, f"unsupported version {obj.get('version')!r}; "
                               f"this reader knows {FORMAT_VERSION}", "version")
    mal = obj.get("max_len_tokens")
    if mal is not None:
        mal = _int_field(path, 1, "max_len_tokens", mal, 1)
    bs = _int_field(path, 1, "block_size_tokens",
                    obj.get("block_size_tokens", DEFAULT_BLOCK_SIZE), 1)
    meta = obj.get("meta", {})
    if not isinstance(meta, dict):
        raise TraceFormatError(path, 1, "must be a JSON object", "meta")
    return mal, bs, meta


def parse_trajectories(lines: Iterable[str], path: str = "<input>") -> TrajectoryFile:
    """Parse format-1 lines (header first). All or nothing; errors name `path:line`."""
    header: tuple[int | None, int, dict[str, Any]] | None = None
    trajectories: list[Trajectory] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        obj = parse_json_line(path, lineno, raw)
        if header is None:
            if lineno != 1:
                raise TraceFormatError(path, lineno, "the header must be on line 1")
            header = _parse_header(path, obj)
            continue
        unknown = sorted(set(obj) - set(_TRAJ_FIELDS))
        if unknown:
            raise TraceFormatError(path, lineno, f"unknown field; valid: {list(_TRAJ_FIELDS)}",
                                   unknown[0])
        for name in _TRAJ_FIELDS:
            if name not in obj:
                raise TraceFormatError(path, lineno, "missing", name)
        tid = obj["id"]
        if not isinstance(tid, str):
            raise TraceFormatError(path, lineno, f"must be a string, got {tid!r}", "id")
        if tid in seen:
            raise TraceFormatError(path, lineno, f"duplicate id {tid!r} (first on line "
                                   f"{seen[tid]})", "id")
        seen[tid] = lineno
        append = _lengths(path, lineno, "append_tokens", obj["append_tokens"])
        gen = _lengths(path, lineno, "gen_tokens", obj["gen_tokens"])
        if len(append) != len(gen):
            raise TraceFormatError(path, lineno, f"{len(gen)} turns but append_tokens has "
                                   f"{len(append)}", "gen_tokens")
        t = Trajectory(append, gen, tid)
        mal = header[0]
        if mal is not None and t.total_tokens > mal:
            raise TraceFormatError(path, lineno, f"total {t.total_tokens} tokens exceeds the "
                                   f"header's max_len_tokens {mal}", "append_tokens")
        trajectories.append(t)
    if header is None:
        raise TraceFormatError(path, 0, EMPTY)
    mal, bs, meta = header
    return TrajectoryFile(tuple(trajectories), mal, bs, meta)


def load_trajectories(path: str | Path) -> TrajectoryFile:
    """Load and validate a trajectory JSONL file (see the module docstring for the format)."""
    p = str(path)
    try:
        with open(p, encoding="utf-8") as f:
            return parse_trajectories(f, p)
    except OSError as exc:
        raise TraceFormatError(p, 0, f"cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise TraceFormatError(p, 0, f"not UTF-8 text: {exc.reason}") from None


def trajectory_file(
    trajectories: Sequence[Trajectory], max_len_tokens: int | None = None,
    block_size_tokens: int = DEFAULT_BLOCK_SIZE, meta: dict[str, Any] | None = None,
) -> TrajectoryFile:
    """Convenience constructor with a fresh meta dict."""
    return TrajectoryFile(tuple(trajectories), max_len_tokens, block_size_tokens, dict(meta or {}))
