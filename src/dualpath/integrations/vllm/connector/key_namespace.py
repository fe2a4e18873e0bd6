"""The namespace a request's block keys chain from: what must match for stored KV to be
reusable (`namespace_key`: the connector's format, the model, its dtype and KV shape), the
model named by its weights rather than by where they lie (`model_identity`). Pure: no vllm,
no torch."""

from __future__ import annotations

import hashlib
from pathlib import Path

from dualpath.core.blocks import KEY_BYTES


def namespace_key(*parts: object) -> bytes:
    """The parent key of a block chain: a hash of what must match for KV to be reusable."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.digest()


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
SAMPLE_BYTES = 1 << 20


def model_identity(model: str) -> str:
    """What names a model's weights in the key namespace, wherever its folder lies: for a
    local folder, a hash of its `config.json` and, per weight file (sorted by name), its
    name, size and first and last MiB (a fine-tune differs there; the whole files of a large
    model would take minutes to hash). Anything else (a hub id) is itself. Two instances
    with the same weights at different paths (two hosts' mounts) then share their blocks."""
    root = Path(model)
    if not root.is_dir():
        return model
    h = hashlib.blake2b(digest_size=16)
    config = root / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for f in sorted(x for x in root.iterdir() if x.is_file() and x.suffix in WEIGHT_SUFFIXES):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with f.open("rb") as fh:
            h.update(fh.read(SAMPLE_BYTES))
            fh.seek(max(size - SAMPLE_BYTES, 0))
            h.update(fh.read(SAMPLE_BYTES))
    return "weights:" + h.hexdigest()
