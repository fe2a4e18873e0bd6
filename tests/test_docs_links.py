"""The docs stay true to the tree: every relative link and anchor in README.md and docs/ resolves,
every repository path they quote exists, every file in architecture.md's module map exists, the
docs pages cited by code exist, and the pages keep to their length limits.

The generated reproduction report (docs/reproduction/) is checked by its own generator, not here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GENERATED = (DOCS / "reproduction", DOCS / "figures")
TOP_DIRS = ("src", "benchmarks", "tests", "tools", "examples", "research", "deploy", "docs")
README_MAX_LINES = 100
PAGE_MAX_LINES = 300
DOCS_MAX_LINES = 2500

LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
# A repository path: one of the top folders, then path characters (globs allowed), not part
# of a longer path or a URL.
REPO_PATH = re.compile(
    rf"(?<![\w./$-])(?:{'|'.join(TOP_DIRS)})/[\w./*-]*"
)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _pages() -> list[Path]:
    pages = [ROOT / "README.md"]
    for page in sorted(DOCS.rglob("*.md")):
        if not any(page.is_relative_to(g) for g in GENERATED):
            pages.append(page)
    return pages


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_slug(h) for h in HEADING.findall(text)}


def _exists(path: str) -> bool:
    path = path.rstrip(".,;:")
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


@pytest.mark.parametrize("page", _pages(), ids=_rel)
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    bad = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    assert not bad, f"{_rel(page)}: " + "; ".join(bad)


@pytest.mark.parametrize("page", _pages(), ids=_rel)
def test_every_quoted_repository_path_exists(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    quoted = " ".join(FENCE.findall(text) + INLINE_CODE.findall(FENCE.sub("", text)))
    missing = sorted({p for p in REPO_PATH.findall(quoted) if not _exists(p)})
    assert not missing, f"{_rel(page)} quotes paths that do not exist: {missing}"


def _module_map() -> list[str]:
    """The files and folders of architecture.md's module map, as paths from the repository root.

    The map is a fenced block starting `src/dualpath/`; an entry is a line whose first word ends
    in `.py` or `/`, indented two spaces per level (deeper lines are continuations)."""
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    block = next(b for b in FENCE.findall(text) if b.splitlines()[1].startswith("src/dualpath/"))
    stack: list[str] = []
    paths = []
    for line in block.splitlines()[1:-1]:
        indent = len(line) - len(line.lstrip(" "))
        word = line.split()[0] if line.strip() else ""
        if indent % 2 or indent > 16 or not (word.endswith(".py") or word.endswith("/")):
            continue
        depth = indent // 2
        stack = [*stack[:depth], word]
        paths.append("".join(stack))
    return paths


def test_architecture_module_map_names_only_files_that_exist() -> None:
    paths = _module_map()
    assert len(paths) > 50, "the module map was not found or not parsed"
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"docs/architecture.md's module map names missing files: {missing}"


def test_docs_pages_cited_by_code_exist() -> None:
    cited = re.compile(r"(?<![\w/.-])docs/[\w./-]*[\w/]")
    sources = [ROOT / "Makefile", ROOT / "pyproject.toml"]
    for top in ("src", "benchmarks", "tests", "tools", "examples", "research"):
        sources += ROOT.glob(f"{top}/**/*.py")
    bad = []
    for source in sources:
        if source == Path(__file__).resolve():
            continue
        for path in cited.findall(source.read_text(encoding="utf-8")):
            if not (ROOT / path).exists():
                bad.append(f"{source.relative_to(ROOT)}: {path}")
    assert not bad, "code cites docs that do not exist: " + "; ".join(bad)


def test_pages_keep_to_their_length() -> None:
    lengths = {_rel(p): len(p.read_text(encoding="utf-8").splitlines()) for p in _pages()}
    readme = lengths.pop("README.md")
    assert readme <= README_MAX_LINES, f"README.md has {readme} lines (at most {README_MAX_LINES})"
    long = {p: n for p, n in lengths.items() if n > PAGE_MAX_LINES}
    assert not long, f"pages over {PAGE_MAX_LINES} lines: {long}"
    total = sum(lengths.values())
    assert total <= DOCS_MAX_LINES, (
        f"docs/ outside the report has {total} lines (at most {DOCS_MAX_LINES})")
