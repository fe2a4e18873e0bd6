"""What a study gets and gives back: the `Context` every advisor sweep and reproduced figure
runs in (where to write, the shared run cache, the scale), and the `Section` of markdown, files
and checked claims it returns; with the table and CSV helpers they share."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dualpath.core.read_rate import StorageReadModel
from dualpath.plan.runner import Runner


@dataclass
class Context:
    """What every experiment gets: where to write, the shared run cache, the scale."""

    out_dir: Path
    runner: Runner = field(default_factory=Runner)
    is_quick: bool = False
    agents: tuple[int, ...] = ()
    """Override of an experiment's agent counts (empty: its default for the scale)."""
    mals: tuple[str, ...] = ()
    """Override of an experiment's MAL columns (empty: its default)."""
    setups: tuple[str, ...] = ()
    """Override of an experiment's setups (empty: its default)."""
    online_duration_s: float = 0.0
    """Override of the simulated length of online runs (0: 600 s quick, 7,200 s full)."""
    scale_out: int = 0
    """Table 3's scale factor k (0: 2 quick, 4 full; the paper's is 24 offline, 22 online)."""
    storage_read: StorageReadModel | None = None
    """Override of the storage read model of online runs (None: each hardware's calibrated
    record), as `dualpath advise --storage-read` sets it."""

    @property
    def scale(self) -> str:
        return "quick (scaled down)" if self.is_quick else "full"

    def path(self, name: str) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        return self.out_dir / name


@dataclass(frozen=True)
class Claim:
    """One claim the paper states, checked against this run: pass or fail, never tuned."""

    claim: str
    paper: str
    ours: str
    is_pass: bool
    rule: str
    """What passing means (the tolerance)."""
    cause: str = ""
    """Where a failure's cause is known: what it is (the report's notes explain it)."""

    def as_row(self, scale: str) -> list[object]:
        why = self.cause if not self.is_pass and self.cause else ""
        return [self.claim, self.paper, self.ours, "pass" if self.is_pass else "**FAIL**",
                self.rule, why, scale]


@dataclass(frozen=True)
class Section:
    """One experiment's part of the report."""

    key: str
    title: str
    body: str
    """Markdown, without the heading."""
    files: tuple[Path, ...]
    wall_s: float
    scale: str
    claims: tuple[Claim, ...] = ()
    """The paper's claims this experiment checks (the report's claims table)."""


def within(ours: float, paper: float, rel: float) -> bool:
    """`ours` within `rel` (a fraction) of `paper`."""
    return abs(ours / paper - 1.0) <= rel


def fmt(v: float | None, digits: int = 0) -> str:
    """A number for a table; `-` for missing."""
    if v is None:
        return "-"
    return f"{v:,.{digits}f}"


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def write_csv(path: Path, header: Sequence[str], rows: Sequence[Sequence[object]]) -> Path:
    """Write rows (floats with 6 significant digits)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        for row in rows:
            w.writerow([f"{c:.6g}" if isinstance(c, float) else c for c in row])
    return path


def section_markdown(s: Section, base: Path) -> str:
    """`## title`, the body, the figures inline and the CSV files linked, relative to `base`."""
    lines = [f"## {s.title}", "", f"*Scale: {s.scale}; simulated in {s.wall_s:.0f} s wall.*", ""]
    lines.append(s.body.rstrip())
    lines.append("")
    for f in s.files:
        rel = _rel(f, base)
        if f.suffix == ".png":
            lines.append(f"![{f.stem}]({rel})")
            lines.append("")
    data = [f for f in s.files if f.suffix == ".csv"]
    if data:
        lines.append("Data: " + ", ".join(f"[{f.name}]({_rel(f, base)})" for f in data))
        lines.append("")
    return "\n".join(lines)


def _rel(f: Path, base: Path) -> str:
    try:
        return str(f.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(f)
