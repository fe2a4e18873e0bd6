"""The optional mypyc build of the simulator: used only when current, and identical in results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dualpath
from dualpath import _compiled

_SO = ".cpython-311-x86_64-linux-gnu.so"


@pytest.fixture
def fake_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A package tree with every listed module's source, as `status()` sees it."""
    root = tmp_path / "dualpath"
    for module in _compiled.COMPILED_MODULES:
        src = root.joinpath(*module.split(".")[1:]).with_suffix(".py")
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_text(f"# {module}\n", encoding="utf-8")
    monkeypatch.setattr(_compiled, "PACKAGE_ROOT", root)
    monkeypatch.setattr(_compiled, "MANIFEST", root / "_compiled.json")
    monkeypatch.delenv(_compiled.PURE_ENV, raising=False)
    return root


def _build(root: Path) -> None:
    for module in _compiled.COMPILED_MODULES:
        _compiled.source_path(module).with_suffix(_SO).write_bytes(b"")
    _compiled.MANIFEST.write_text(json.dumps(_compiled.source_digests()), encoding="utf-8")


def test_a_current_build_is_used(fake_tree: Path) -> None:
    assert _compiled.status().startswith("pure (not compiled")
    _build(fake_tree)
    assert _compiled.status() == "compiled"


def test_a_changed_source_makes_the_build_stale(fake_tree: Path) -> None:
    _build(fake_tree)
    src = _compiled.source_path("dualpath.sim.flows")
    src.write_text(src.read_text(encoding="utf-8") + "x = 1\n", encoding="utf-8")
    state = _compiled.status()
    assert state.startswith("pure (stale build") and "dualpath.sim.flows" in state


def test_missing_record_partial_build_and_the_override_fall_back(
    fake_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _build(fake_tree)
    monkeypatch.setenv(_compiled.PURE_ENV, "1")
    assert "DUALPATH_PURE_PYTHON" in _compiled.status()
    monkeypatch.delenv(_compiled.PURE_ENV)
    _compiled.source_path("dualpath.sim.kernel").with_suffix(_SO).unlink()
    assert _compiled.status().startswith("pure (partial build")
    _build(fake_tree)
    _compiled.MANIFEST.unlink()
    assert _compiled.status().startswith("pure (no build record")


_RUN = """
import io, json, sys
import dualpath
from dualpath.core.cluster import ClusterSpec
from dualpath.core.hardware import hardware_preset
from dualpath.core.model import model_preset
from dualpath.sim import Driver, SimConfig, simulate
from dualpath.sim.workload import agent_workload

import dualpath.sim.simulator as s
out = {"implementation": dualpath.IMPLEMENTATION, "file": s.__file__}
cl = ClusterSpec(hardware_preset("h800-deepseek"), model_preset("deepseek-v3.2"), 1, 2)
wl = agent_workload("64k", 24)
for mode in ("basic", "dualpath", "split"):
    r = simulate(SimConfig(cl, wl, driver=Driver(num_agents=24)).with_mode(mode))
    buf = io.StringIO()
    r.write_csv(buf)
    out[mode] = [buf.getvalue(), json.dumps(r.summary(), sort_keys=True, default=repr)]
print(json.dumps(out))
"""


def _run(pure: bool) -> dict[str, object]:
    env = dict(os.environ)
    env.pop(_compiled.PURE_ENV, None)
    if pure:
        env[_compiled.PURE_ENV] = "1"
    done = subprocess.run([sys.executable, "-c", _RUN], env=env, capture_output=True,
                          text=True, check=True, timeout=600)
    return dict(json.loads(done.stdout.splitlines()[-1]))


@pytest.mark.skipif(dualpath.IMPLEMENTATION != "compiled",
                    reason=f"compiled simulator not in use: {dualpath.IMPLEMENTATION}")
def test_compiled_and_pure_python_give_identical_results() -> None:
    compiled, pure = _run(pure=False), _run(pure=True)
    assert compiled["implementation"] == "compiled" and str(compiled["file"]).endswith(".so")
    assert str(pure["implementation"]).startswith("pure") and str(pure["file"]).endswith(".py")
    for mode in ("basic", "dualpath", "split"):
        assert compiled[mode] == pure[mode], mode
