"""The paper's published numbers, for calibration and side-by-side reports.

Fig. 7 JCTs are values read off the figure (about +-5%); `*_approx` marks values read above a
broken axis. Source: DualPath (arXiv 2602.21548) Fig. 7 and Table 2, as digested in the project's
shared reference `paper-calibration.json` (shipped as package data).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

SYSTEMS = ("oracle", "dualpath", "basic")


@dataclass(frozen=True)
class Fig7Point:
    """One (model setup, agents, MAL) cell of Fig. 7: JCT in seconds per system."""

    setup: str
    """`ds27b_1p1d` or `ds660b_2p4d`."""
    agents: int
    mal: str
    jct_s: dict[str, float]
    is_approx: dict[str, bool]


@cache
def _raw() -> dict[str, Any]:
    text = (resources.files("dualpath") / "data" / "paper_calibration.json").read_text("utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def fig7(setup: str) -> list[Fig7Point]:
    """All Fig. 7 cells of one setup (`ds27b_1p1d` or `ds660b_2p4d`; none for others, e.g.
    Qwen, whose values the digest does not give)."""
    rows = _raw().get(setup, [])
    points = []
    for row in rows:
        jct = {s: float(row[s]) for s in SYSTEMS if row.get(s) is not None}
        approx = {s: bool(row.get(f"{s}_approx", False)) for s in SYSTEMS}
        points.append(Fig7Point(setup, int(row["agents"]), str(row["mal"]), jct, approx))
    return points


def fig7_point(setup: str, agents: int, mal: str) -> Fig7Point | None:
    """The Fig. 7 cell for these agents and MAL, if the paper has one."""
    for p in fig7(setup):
        if p.agents == agents and p.mal == mal:
            return p
    return None


def table2() -> list[dict[str, int]]:
    """Table 2 rows: max_len, turns, append, gen, total, context."""
    return [dict(r) for r in _raw()["table2"]]


CLAIMS: dict[str, str] = {
    "fig7": "Offline: DualPath up to 1.87x over Basic on DS 660B (close to Oracle); up to 1.78x "
    "on DS 27B, still 1.09-1.85x slower than Oracle due to 1P1D storage bandwidth.",
    "fig8": "P/D ratio (DS 27B): average speedup 1.64x, up to 2.46x; pairs with equal available "
    "storage bandwidth perform alike (DualPath 1P1D ~ Basic 2P1D; DualPath 2P1D ~ DualPath 1P2D).",
    "fig9": "Append/generation scaling (DS 660B, 64K, 1024 agents): speedup 1.82-1.99x across "
    "append scales; Basic approaches DualPath as appends grow; the generation-length trend is "
    "similar.",
    "fig10": "Online: SLO capacity (TTFT <= 4 s, TPOT <= 50 ms) 1.67x Basic for DS 27B 1P1D and "
    "2.25x for DS 660B 2P4D (average 1.96x).",
    "fig12": "Ablation (DS 660B, 64K, 1024/2048 agents), JCT reduction vs Basic: +layerwise "
    "-17.21%, +dual-path -38.19%, +scheduling -45.62%.",
    "fig13": "Storage-NIC traffic Max/Avg over three machines: 1.53 (round robin) -> 1.18.",
    "fig14": "Attention-time Max/Avg across an EP group as low as 1.06 in the first 5% of "
    "the task.",
    "table3": "Near-linear scaling: 2P4D with 2K agents vs 48P96D with 48K agents at similar JCT; "
    "online 2P4D at 0.4 APS vs 44P88D at 8.8 APS (22x) at similar latency.",
}
