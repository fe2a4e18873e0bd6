"""Sections of `docs/reproduction.md`: each experiment returns one, with its CSV/PNG files;
`write_report` assembles them under a header that states how the numbers were made."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dualpath.core.datafile import write_text_atomic
from dualpath.core.storage import StorageReadModel
from dualpath.experiments.runner import Runner


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


CLAIMS_FILE = "claims_{key}.json"


def write_claims(out_dir: Path, s: Section) -> Path:
    """Store `s.claims` beside its section, so a later report (or one that includes this run
    as a separate full-size run) can list them."""
    path = out_dir / CLAIMS_FILE.format(key=s.key)
    write_text_atomic(path, json.dumps({"scale": s.scale, "claims": [asdict(c) for c in s.claims]},
                                       indent=1) + "\n")
    return path


def claims_markdown(out_dir: Path, order: Sequence[str]) -> tuple[str, int, int]:
    """The claims table of `out_dir`'s runs (its own `claims_*.json`, in `order` of keys) and
    of every separate run below `out_dir/full`; with the pass and total counts."""
    rows: list[list[object]] = []
    num_pass = 0
    sources = [(out_dir / CLAIMS_FILE.format(key=k), "") for k in order]
    full = out_dir / "full"
    if full.is_dir():
        sources += [(f, f.parent.relative_to(full).as_posix())
                    for f in sorted(full.rglob("claims_*.json"))]
    for path, where in sources:
        if not path.exists():
            continue
        doc = json.loads(path.read_text(encoding="utf-8"))
        scale = f"full ({where})" if where else str(doc["scale"]).split(" ")[0]
        for c in doc["claims"]:
            claim = Claim(**c)
            rows.append(claim.as_row(scale))
            num_pass += claim.is_pass
    if not rows:
        return "", 0, 0
    text = ("## Claims: the paper's statements, pass or fail\n\n"
            f"**{num_pass} of {len(rows)} pass.** One row per claim the paper states (values "
            "read off its figures, about +-5%) and per run that checks it; `quick` rows come "
            "from this report's scaled-down runs, `full` rows from the separate full-size runs "
            "at the end. Nothing is tuned to pass: the only parameter fitted to Basic or "
            "DualPath cells is the storage read rate (on DS 27B 1P1D Basic, 32K and 64K).\n\n"
            + md_table(["claim", "paper", "ours", "result", "pass rule", "known cause of a failure",
                        "scale"], rows) + "\n")
    return text, num_pass, len(rows)


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


def write_report(path: Path, sections: Sequence[Section], header: str,
                 addenda: Mapping[str, str] | None = None) -> Path:
    """The whole report: `header` (markdown), then every section in order, each followed by
    its hand-written addendum (`addenda`: section key -> markdown), if any."""
    parts = [header.rstrip(), ""]
    for s in sections:
        parts.append(section_markdown(s, path.parent))
        extra = (addenda or {}).get(s.key, "").strip()
        if extra:
            parts += [extra, ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts), encoding="utf-8")
    return path
