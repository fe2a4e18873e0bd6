"""One version, three places that agree: `dualpath --version`, the installed metadata (from
`dualpath.__version__` through pyproject's dynamic version) and CHANGELOG.md's newest entry."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import dualpath

CHANGELOG = Path(__file__).resolve().parents[1] / "CHANGELOG.md"


def test_version_is_printed_installed_and_in_the_changelog() -> None:
    out = subprocess.run([sys.executable, "-m", "dualpath.cli.main", "--version"],
                         capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == f"dualpath {dualpath.__version__}"
    assert importlib.metadata.version("dualpath") == dualpath.__version__
    entries = re.findall(r"^## (\S+)", CHANGELOG.read_text(encoding="utf-8"), re.M)
    assert entries and entries[0] == dualpath.__version__, entries
