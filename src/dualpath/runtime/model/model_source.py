"""Where a node's model comes from (`ModelSource`) and what is built from it: the model, its
tokenizer, its config (the driver's, without loading weights)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dualpath.core.errors import SpecError


@dataclass(frozen=True)
class ModelSource:
    """How a node builds its model: `tiny` (random weights from `seed`), `smollm2`, or `path`
    (a local Llama/Qwen2 checkpoint folder)."""

    kind: str
    seed: int = 0
    path: str = ""
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.kind not in ("tiny", "smollm2", "path"):
            raise SpecError("model_source", "kind", self.kind, "must be tiny, smollm2 or path")
        if self.kind == "path" and not self.path:
            raise SpecError("model_source", "path", self.path, "needed for kind=path")


def build_model(source: ModelSource) -> Any:
    """The layer-by-layer model of `source` (`llama`, `weights`)."""
    from dualpath.runtime.model import weights

    if source.kind == "tiny":
        return weights.tiny_random_model(source.seed)
    if source.kind == "smollm2":
        return weights.load_smollm2()
    return weights.load_checkpoint(Path(source.path))


def model_tokenizer(source: ModelSource) -> Any:
    """The `Tokenizer` of `source` with its chat template: the checkpoint's own, or
    byte-level (ChatML) for `tiny`."""
    from dualpath.runtime.model import weights
    from dualpath.runtime.model.tokenizer import Tokenizer

    if source.kind == "tiny":
        return Tokenizer.byte_level(weights.tiny_config().vocab_size)
    if source.kind == "smollm2":  # the GGUF carries the vocabulary and the chat template
        return Tokenizer.from_gguf(weights.smollm2_gguf_path())
    return weights.load_tokenizer(Path(source.path))


def model_config(source: ModelSource) -> Any:
    """The `ModelConfig` of `source` without loading weights (what the driver needs)."""
    from dualpath.runtime.model import weights

    if source.kind == "tiny":
        return weights.tiny_config()
    folder = weights.smollm2_folder() if source.kind == "smollm2" else Path(source.path)
    return weights.config_from_hf(folder)
