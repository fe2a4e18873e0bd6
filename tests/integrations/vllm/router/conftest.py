"""Fixtures of the router's tests over stand-in instances (`fakes.py`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fakes import BLOCK_BYTES, BS, Fake

from dualpath.integrations.vllm.manifest import StoreManifest


@pytest.fixture()
def store(tmp_path: Path) -> tuple[Path, StoreManifest]:
    manifest = StoreManifest(namespace="ab" * 16, model="m", block_size=BS,
                             full_block_bytes=BLOCK_BYTES)
    root = tmp_path / "store"
    manifest.write(root)
    return root, manifest


@pytest.fixture()
def fakes(tmp_path: Path) -> Iterator[Callable[..., Fake]]:
    made: list[Fake] = []

    def make(hold: str | None = None, *flags: str) -> Fake:
        made.append(Fake(tmp_path / f"fake{len(made)}.jsonl", hold, *flags))
        return made[-1]

    try:
        yield make
    finally:
        for f in made:
            f.close()
