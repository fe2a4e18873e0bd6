"""The simulator's hot modules, optionally compiled with mypyc (`make` builds them; see
`tools/compile.py`). Compiled and pure-Python modules give byte-identical results
(`tests/sim/test_compiled.py`); compiling is only for speed.

A compiled module (`*.so` next to its `.py`) is used only while it matches its source: the build
records each source's SHA-256 in `_compiled.json`, and `install()` (run when `dualpath` is
imported) routes every listed module back to its `.py` when any source changed since, when the
record is missing, or when `DUALPATH_PURE_PYTHON=1` is set. The modules of one build call each
other natively, so they are used all together or not at all.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

COMPILED_MODULES: tuple[str, ...] = (
    "dualpath.sim.kernel",
    "dualpath.sim.flows",
    "dualpath.sim.state",
    "dualpath.sim.sched_adapter",
    "dualpath.sim.topology",
    "dualpath.sim.dispatch",
    "dualpath.sim.reads",
    "dualpath.sim.prefill",
    "dualpath.sim.handlers",
    "dualpath.sim.drivers",
    "dualpath.sim.simulator",
    "dualpath.sched.types",
    "dualpath.sched.params",
    "dualpath.sched.cost",
    "dualpath.sched.pe",
    "dualpath.sched.de",
    "dualpath.sched.path",
    "dualpath.sched.batching",
    "dualpath.sched.snapshot",
    "dualpath.sched.scheduler",
)
"""Modules compiled together (one mypyc group). Their frozen dataclasses that cross process
boundaries pickle by constructor (`dualpath.core.pickling`)."""

PACKAGE_ROOT = Path(__file__).resolve().parent
MANIFEST = PACKAGE_ROOT / "_compiled.json"
PURE_ENV = "DUALPATH_PURE_PYTHON"


def source_path(module: str) -> Path:
    """The `.py` file of a module in `COMPILED_MODULES`."""
    return PACKAGE_ROOT.joinpath(*module.split(".")[1:]).with_suffix(".py")


def source_digests() -> dict[str, str]:
    """SHA-256 of each compiled module's source, as the build records it."""
    return {m: hashlib.sha256(source_path(m).read_bytes()).hexdigest() for m in COMPILED_MODULES}


def _has_extension(module: str) -> bool:
    src = source_path(module)
    return any(src.with_suffix(suf).exists() for suf in importlib.machinery.EXTENSION_SUFFIXES)


def status() -> str:
    """`compiled`, or `pure (<why>)`: which implementation `import dualpath.sim` gets."""
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return f"pure ({PURE_ENV} is set)"
    if not any(_has_extension(m) for m in COMPILED_MODULES):
        return "pure (not compiled: run `make compile`)"
    if not all(_has_extension(m) for m in COMPILED_MODULES):
        return "pure (partial build: run `make compile`)"
    try:
        recorded = json.loads(MANIFEST.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "pure (no build record: run `make compile`)"
    stale = [m for m, digest in source_digests().items() if recorded.get(m) != digest]
    if stale:
        return f"pure (stale build, changed since: {', '.join(stale)}; run `make compile`)"
    return "compiled"


class _SourceFinder:
    """Finds the listed modules as their `.py` sources (ahead of the default finder, which
    prefers an extension module next to its source)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in COMPILED_MODULES:
            return None
        return importlib.util.spec_from_file_location(fullname, source_path(fullname))


_installed = False


def install() -> str:
    """Route the compiled modules to their sources unless the build is present and current;
    warns when a build exists but is stale. Returns `status()`."""
    global _installed
    state = status()
    if state != "compiled" and not _installed:
        if any(m in sys.modules for m in COMPILED_MODULES):  # pragma: no cover - import order
            raise RuntimeError("dualpath._compiled.install() must run before dualpath.sim")
        sys.meta_path.insert(0, _SourceFinder())
        _installed = True
        if "stale" in state or "partial" in state:
            warnings.warn(f"dualpath: compiled simulator not used, {state}", stacklevel=2)
    return state
