"""Errors for trace files: each names the file, the line and the field."""

from __future__ import annotations

from dualpath.core.errors import DualPathError


class TraceFormatError(DualPathError, ValueError):
    """A trace file line is invalid. Message: `path:line: field 'name': why` (field optional)."""

    def __init__(self, path: str, line: int, why: str, field: str | None = None) -> None:
        self.path = path
        self.line = line
        self.field = field
        self.why = why
        where = f"{path}:{line}: " if line > 0 else f"{path}: "
        what = f"field {field!r}: " if field else ""
        super().__init__(f"{where}{what}{why}")

    def __reduce__(self) -> tuple[type[TraceFormatError], tuple[str, int, str, str | None]]:
        # Raised in a worker process (a sweep's trace), it must unpickle in the parent.
        return type(self), (self.path, self.line, self.why, self.field)
