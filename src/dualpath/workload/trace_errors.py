"""Errors for trace files: each names the file, the line and the field."""

from __future__ import annotations

from dualpath.core.errors import DualPathError


class TraceFormatError(DualPathError, ValueError):
    """A trace file line is invalid. Message: `path:line: field 'name': why` (field optional)."""

    def __init__(self, path: str, line: int, why: str, field: str | None = None) -> None:
        self.path = path
        self.line = line
        self.field = field
        where = f"{path}:{line}: " if line > 0 else f"{path}: "
        what = f"field {field!r}: " if field else ""
        super().__init__(f"{where}{what}{why}")
