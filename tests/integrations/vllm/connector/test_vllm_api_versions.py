"""The connector against vLLM's API of every release in `vllm_api.json` (0.26 to 0.34), read
statically from each release's sdist by `tools/vllm_api.py` (no vLLM needed: runs in `.venv`).

A failure names the release and the method, import or attribute; the fix goes into the
connector or, where releases differ, into `connector/compat.py`. After a change to what the
connector imports: `python tools/vllm_api.py snapshot` (fetches the sdists once)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[4]


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_api", REPO / "tools" / "vllm_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_api"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


api = _load_tool()
SNAPSHOT = api.load_snapshot()
VERSIONS = sorted(SNAPSHOT["versions"])


def test_the_snapshot_holds_each_release_with_its_sha256() -> None:
    assert {"0.26.0", "0.28.0", "0.32.0", "0.33.0", "0.34.0"} <= set(VERSIONS)
    for v in VERSIONS:
        release = SNAPSHOT["versions"][v]["release"]
        assert release["file"] == f"vllm-{v}.tar.gz"
        assert re.fullmatch(r"[0-9a-f]{64}", release["sha256"])


@pytest.mark.parametrize("version", VERSIONS)
def test_the_connector_fits_the_api_of(version: str) -> None:
    errors, _ = api.check(SNAPSHOT["versions"][version], api.surface())
    assert not errors, f"vLLM {version}:\n" + "\n".join(errors)


def test_a_mismatch_is_named_with_its_method_and_release(tmp_path: Path) -> None:
    """An override whose parameter is renamed, a dropped override and an import of a name a
    release lacks are each reported, per release."""
    files = []
    for path in api.connector_files():
        files.append(tmp_path / path.name)
        shutil.copy(path, files[-1])
    replaced = dict.fromkeys((
        ("def get_finished(self, finished_req_ids: set[str])",
         "def get_finished(self, ids: set[str])"),
        ("def requires_kv_delivery(self)", "def _requires_kv_delivery(self)"),
        ("from vllm.logger import init_logger",
         "from vllm.logger import init_logger\n"
         "from vllm.v1.metrics.cache_hit_source import CacheHitSource")), 0)
    for f in files:
        text = f.read_text()
        for old, new in replaced:
            if old in text:
                text = text.replace(old, new)
                replaced[(old, new)] += 1
        f.write_text(text)
    assert all(n == 1 for n in replaced.values()), replaced
    ours = api.surface(files)
    for v in VERSIONS:
        errors = "\n".join(api.check(SNAPSHOT["versions"][v], ours)[0])
        assert "DualPathConnector (dualpath_connector.py).get_finished names parameter 1 " \
               "'ids', vLLM's is 'finished_req_ids'" in errors, v
        has_delivery = v >= "0.28.0"
        assert ("must override requires_kv_delivery" in errors) == has_delivery, v
        has_source = v >= "0.32.0"
        assert ("import CacheHitSource: no such module" in errors) != has_source, v


def test_the_api_changes_as_the_released_sources_have_them() -> None:
    """What docs/vllm/gpu.md states of the releases, from their sources: the constructor takes
    kv_cache_config and handle_preemptions the connector metadata in every release;
    requires_kv_delivery exists from 0.28, defaulting to the role's is_kv_producer."""
    base = "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorBase_V1"
    for v in VERSIONS:
        methods = SNAPSHOT["versions"][v]["classes"][base]["methods"]
        assert methods["__init__"]["params"][3] == ["kv_cache_config", "pos", False], v
        assert [p[0] for p in methods["handle_preemptions"]["params"]] == [
            "self", "kv_connector_metadata"], v
        delivery = methods.get("requires_kv_delivery")
        if v < "0.28.0":
            assert delivery is None
        else:
            assert delivery["kind"] == "property"
            assert delivery["returns"] == "self._kv_transfer_config.is_kv_producer"
