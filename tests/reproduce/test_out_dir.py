"""`dualpath reproduce` writes where the user says, by default into the git-ignored `out/`: run
in a checkout it leaves `git status` clean. The committed report (`docs/reproduction/`) keeps
its figures beside it, so every relative link in it resolves."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dualpath.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                          cwd=cwd, check=True, capture_output=True, text=True).stdout


def test_default_out_is_ignored_and_dualpath_out_moves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "checkout"
    repo.mkdir()
    shutil.copy(ROOT / ".gitignore", repo / ".gitignore")
    _git(repo, "init", "-q")
    _git(repo, "add", ".gitignore")
    _git(repo, "commit", "-qm", "the project's ignore rules")
    monkeypatch.chdir(repo)
    monkeypatch.delenv("DUALPATH_OUT", raising=False)
    assert main(["reproduce", "table1", "--quick", "--quiet"]) == 0
    assert (repo / "out" / "reproduce" / "section_table1.md").is_file()
    assert _git(repo, "status", "--porcelain", "--untracked-files=all") == ""
    monkeypatch.setenv("DUALPATH_OUT", str(tmp_path / "elsewhere"))
    assert main(["reproduce", "table1", "--quick", "--quiet"]) == 0
    assert (tmp_path / "elsewhere" / "reproduce" / "section_table1.md").is_file()


def test_committed_report_links_resolve() -> None:
    folder = ROOT / "docs" / "reproduction"
    text = (folder / "README.md").read_text(encoding="utf-8")
    links = {m for m in re.findall(r"\]\(([^)#\s]+)\)", text) if "://" not in m}
    assert links, "the report links its figures and data"
    missing = sorted(link for link in links if not (folder / link).exists())
    assert not missing, missing
