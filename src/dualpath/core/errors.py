"""Errors that name what is wrong, so the CLI can print one line and exit 2."""

from __future__ import annotations


class DualPathError(Exception):
    """Base class for user-facing errors (bad input, unknown preset, bad file)."""


class SpecError(DualPathError, ValueError):
    """A spec field holds an invalid value; the message names the field and the value."""

    def __init__(self, owner: str, field: str, value: object, why: str) -> None:
        self.owner = owner
        self.field = field
        self.value = value
        self.why = why
        super().__init__(f"{owner}.{field}={value!r}: {why}")

    def __reduce__(self) -> tuple[type[SpecError], tuple[str, str, object, str]]:
        # Raised in a worker process (`Runner(jobs=N)`), it must unpickle in the parent.
        return type(self), (self.owner, self.field, self.value, self.why)


class UnknownPresetError(DualPathError, KeyError):
    """A preset name that is not registered; the message lists the valid names."""

    def __init__(self, kind: str, name: str, valid: list[str]) -> None:
        self.kind = kind
        self.name = name
        self.valid = list(valid)
        super().__init__(f"unknown {kind} preset {name!r}; valid: {', '.join(sorted(valid))}")

    def __reduce__(self) -> tuple[type[UnknownPresetError], tuple[str, str, list[str]]]:
        return type(self), (self.kind, self.name, self.valid)

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])
