"""GGUF files (llama.cpp's format), read for the tokenizer (its vocabulary, merges and chat
template) and for the weights (tensors and model config): a fast reader and its metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dualpath.core.errors import DualPathError


class CheckpointError(DualPathError):
    """A checkpoint folder or GGUF file that cannot be loaded; the message names it."""


def open_gguf(path: Path | str) -> Any:
    """A `gguf.GGUFReader` of `path` that parses its metadata 4x faster.

    The stock reader slices an `np.memmap` once per metadata element (~1M slices for a 49k-token
    vocabulary and its merges), and every memmap slice pays a Python-level `__array_finalize__`.
    Viewing the same mapping as a plain ndarray gives identical fields and tensors.
    """
    import gguf

    class _PlainArrayReader(gguf.GGUFReader):  # type: ignore[misc]
        @property
        def data(self) -> Any:
            return self._plain

        @data.setter
        def data(self, value: Any) -> None:
            self._plain = np.asarray(value)

    try:
        return _PlainArrayReader(str(path))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable GGUF file ({exc})") from None


def metadata(reader: Any, key: str, where: str, error: type[DualPathError]) -> Any:
    """The value of `reader`'s metadata field `key`; `error` naming `where` if it is missing."""
    f = reader.fields.get(key)
    if f is None:
        raise error(f"{where}: missing metadata {key!r}")
    return f.contents()
