import json
from pathlib import Path

import pytest

from dualpath.workload.jsonl import (
    load_trajectories,
    save_trajectories,
    trajectory_file,
)
from dualpath.workload.trace_errors import TraceFormatError
from dualpath.workload.trajectory import Trajectory

HEADER = '{"format": "dualpath-trajectories", "version": 1, "max_len_tokens": 1000}'
GOOD = '{"id": "a", "append_tokens": [100, 20], "gen_tokens": [5, 7]}'


def test_round_trip(tmp_path: Path) -> None:
    trajs = [Trajectory((100, 20), (5, 7), "a"), Trajectory((3,), (1,), "b")]
    tf = trajectory_file(trajs, 1000, 16, {"preset": "x", "seed": 3})
    path = tmp_path / "t.jsonl"
    save_trajectories(path, tf)
    back = load_trajectories(path)
    assert back == tf
    assert json.loads(path.read_text().splitlines()[0])["version"] == 1


def _load(tmp_path: Path, *lines: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    load_trajectories(path)


@pytest.mark.parametrize(
    ("lines", "line", "field", "why"),
    [
        ((HEADER, GOOD, '{"id": "b", "append_tokens": [1,'), 3, None, "invalid JSON"),
        ((HEADER, '{"id": "b", "append_tokens": [1, -2], "gen_tokens": [1, 1]}'), 2,
         "append_tokens", ">= 1"),
        ((HEADER, '{"id": "b", "append_tokens": [1], "gen_tokens": [0]}'), 2, "gen_tokens",
         ">= 1"),
        ((HEADER, '{"id": "b", "append_tokens": [1]}'), 2, "gen_tokens", "missing"),
        ((HEADER, GOOD, '{"id": "b", "append_tokens": [1], "gen_tokens": [1], "text": "x"}'), 3,
         "text", "unknown field"),
        ((HEADER, '{"id": "b", "append_tokens": [1, 2], "gen_tokens": [1]}'), 2, "gen_tokens",
         "1 turns"),
        ((HEADER, '{"id": "b", "append_tokens": [1.5], "gen_tokens": [1]}'), 2,
         "append_tokens", "integer"),
        ((HEADER, '{"id": "b", "append_tokens": [], "gen_tokens": []}'), 2, "append_tokens",
         "non-empty"),
        ((HEADER, GOOD, GOOD), 3, "id", "duplicate"),
        ((HEADER, '{"id": 5, "append_tokens": [1], "gen_tokens": [1]}'), 2, "id", "string"),
        ((HEADER, '{"id": "b", "append_tokens": [990], "gen_tokens": [20]}'), 2,
         "append_tokens", "exceeds"),
        ((GOOD,), 1, "format", "header"),
        (('{"format": "dualpath-trajectories", "version": 2}',), 1, "version", "unsupported"),
        (('{"format": "dualpath-trajectories", "version": 1, "maxlen": 5}',), 1, "maxlen",
         "unknown field"),
        ((HEADER, "[1, 2]"), 2, None, "JSON object"),
    ],
)
def test_bad_lines_name_file_line_and_field(
    tmp_path: Path, lines: tuple[str, ...], line: int, field: str | None, why: str
) -> None:
    with pytest.raises(TraceFormatError) as info:
        _load(tmp_path, *lines)
    err = info.value
    assert (err.line, err.field) == (line, field)
    msg = str(err)
    assert msg.startswith(f"{tmp_path / 'bad.jsonl'}:{line}: ")
    assert why in msg
    if field:
        assert repr(field) in msg


def test_empty_and_missing_files(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TraceFormatError, match=": empty$"):
        load_trajectories(tmp_path / "empty.jsonl")
    with pytest.raises(TraceFormatError, match="cannot read"):
        load_trajectories(tmp_path / "nope.jsonl")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TraceFormatError, match="UTF-8"):
        load_trajectories(tmp_path / "bin.jsonl")


def test_blank_lines_are_skipped_and_header_only_is_empty(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(HEADER + "\n\n" + GOOD + "\n   \n")
    tf = load_trajectories(path)
    assert [t.trajectory_id for t in tf.trajectories] == ["a"]
    assert tf.max_len_tokens == 1000 and tf.block_size_tokens == 64
    path.write_text(HEADER + "\n")
    assert load_trajectories(path).trajectories == ()
