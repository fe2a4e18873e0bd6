"""The packaged data files' shared shape: a JSON object with a list of objects `entries`."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from dualpath.core.errors import DualPathError


def read_entries(path: Path, error: type[DualPathError]) -> list[dict[str, Any]]:
    """`path`'s `entries`; `error` names the file (and line) when it cannot be read."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    entries = doc.get("entries") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise error(f"{path}: top level must be an object with a list of objects 'entries'")
    return entries


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temp file in the same folder and a rename, so a
    crash leaves the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
