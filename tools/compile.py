"""Compile the simulator's hot modules with mypyc, in place (`make compile`; `make` runs it).

    python tools/compile.py          # build src/dualpath/**/*.so and record the sources' hashes
    python tools/compile.py --clean  # remove the compiled modules (pure Python again)

The list of modules and the staleness rule live in `dualpath._compiled`. Results are identical
either way; a build that fails leaves the pure-Python package working and says why.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
BUILD = ROOT / "build" / "mypyc"


def _compiled_module() -> ModuleType:
    """`dualpath._compiled`, loaded from its file without importing `dualpath` (whose
    `__init__` would already pick an implementation)."""
    spec = importlib.util.spec_from_file_location("_compiled", SRC / "dualpath" / "_compiled.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _clean() -> int:
    _compiled = _compiled_module()
    removed = 0
    # Every extension module in the package, listed or not (a module dropped from the list
    # must not keep loading an old build).
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        for lib in [*(SRC / "dualpath").rglob(f"*{suffix}"), *SRC.glob(f"*__mypyc{suffix}")]:
            lib.unlink()
            removed += 1
    _compiled.MANIFEST.unlink(missing_ok=True)
    print(f"removed {removed} compiled files")
    return 0


def _build() -> int:
    _compiled = _compiled_module()
    import setuptools  # noqa: F401  (mypyc.build picks setuptools over distutils if imported)
    from mypyc.build import mypycify
    from setuptools import Distribution

    started = time.perf_counter()
    _clean()  # a failed build must not look current, nor leave an old one half in place
    digests = _compiled.source_digests()
    paths = [str(_compiled.source_path(m).relative_to(ROOT)) for m in _compiled.COMPILED_MODULES]
    os.chdir(ROOT)  # mypy reads [tool.mypy] from pyproject.toml
    extensions = mypycify(paths, opt_level="3", target_dir=str(BUILD / "c"))
    dist = Distribution({"name": "dualpath-compiled", "ext_modules": extensions,
                         "package_dir": {"": "src"}})
    cmd = dist.get_command_obj("build_ext")
    cmd.inplace = True  # type: ignore[attr-defined]
    cmd.build_temp = str(BUILD / "temp")  # type: ignore[attr-defined]
    cmd.parallel = os.cpu_count() or 1  # type: ignore[attr-defined]
    dist.run_command("build_ext")
    if _compiled.source_digests() != digests:
        print("sources changed during the build: not recording it", file=sys.stderr)
        return 1
    _compiled.MANIFEST.write_text(json.dumps(digests, indent=1) + "\n", encoding="utf-8")
    print(f"compiled {len(paths)} modules with mypyc in {time.perf_counter() - started:.0f} s")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clean", action="store_true", help="remove the compiled modules")
    args = ap.parse_args()
    return _clean() if args.clean else _build()


if __name__ == "__main__":
    sys.exit(main())
