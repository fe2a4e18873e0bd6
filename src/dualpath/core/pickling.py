"""Pickling frozen dataclasses by their constructor arguments.

The simulator's hot modules may be compiled with mypyc (`dualpath._compiled`), and a compiled
frozen dataclass cannot be unpickled field by field (its `__setattr__` refuses). Registering a
class here pickles it as `cls(*fields)` instead, which works compiled or not and re-runs its
validation on load.
"""

from __future__ import annotations

import copyreg
import dataclasses
from typing import Any


def _by_fields(obj: Any) -> tuple[type, tuple[Any, ...]]:
    return type(obj), tuple(getattr(obj, f.name) for f in dataclasses.fields(obj))


def pickle_by_fields(*classes: type) -> None:
    """Pickle (and copy) instances of these dataclasses as constructor calls; every field
    must be an `__init__` argument, in order."""
    for cls in classes:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} is not a dataclass")
        if not all(f.init for f in dataclasses.fields(cls)):
            raise TypeError(f"{cls.__name__} has fields outside __init__")
        copyreg.pickle(cls, _by_fields)
