"""The transport's errors: one line each, naming what failed."""

from __future__ import annotations

from dualpath.core.errors import DualPathError


class TransferError(DualPathError):
    """A transfer that failed, timed out, went to a peer that is not connected, or addressed
    bytes outside registered memory."""


class BufferFullError(DualPathError):
    """A slot allocation the pool refused: more slots than it holds, or none free in time."""
