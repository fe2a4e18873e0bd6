"""Small validators used by the frozen specs' __post_init__."""

from __future__ import annotations

import math

from dualpath.core.errors import SpecError


def positive(owner: str, field: str, value: float) -> None:
    """Raise SpecError unless value is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(owner, field, value, "must be a number")
    if not math.isfinite(value) or value <= 0:
        raise SpecError(owner, field, value, "must be a finite number > 0")


def non_negative(owner: str, field: str, value: float) -> None:
    """Raise SpecError unless value is a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(owner, field, value, "must be a number")
    if not math.isfinite(value) or value < 0:
        raise SpecError(owner, field, value, "must be a finite number >= 0")


def positive_int(owner: str, field: str, value: int) -> None:
    """Raise SpecError unless value is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(owner, field, value, "must be an integer >= 1")


def non_negative_int(owner: str, field: str, value: int) -> None:
    """Raise SpecError unless value is an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecError(owner, field, value, "must be an integer >= 0")
