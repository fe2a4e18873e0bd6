"""The report (`docs/reproduction/README.md`): each experiment returns a `Section` with its CSV/PNG
files and claims; `write_report` assembles them under a header that states how the numbers
were made, and `claims_markdown` tables every claim checked."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

from dualpath.core.datafile import write_text_atomic
from dualpath.plan.section import Claim, Section, md_table, section_markdown

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
