"""Figures that read correctly when opened: labelled axes with units, legends, paper marks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

COLORS = {
    "oracle": "#4c72b0",
    "dualpath": "#dd8452",
    "basic": "#55a868",
    "split": "#c44e52",
    "round_robin": "#8172b3",
}


@cache
def _plt() -> Any:
    """matplotlib.pyplot on the Agg backend, imported on the first figure: every `dualpath`
    command imports this module, and pyplot alone takes about half a CPU second to import."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(fig: Any, ax: Any, path: Path, title: str, grid_axis: str) -> Path:
    """Title, legend and grid, then save to `path` (folders created) and free the figure."""
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(axis=grid_axis, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return path


def grouped_bars(
    path: Path,
    categories: Sequence[str],
    series: Mapping[str, Sequence[float]],
    ylabel: str,
    title: str,
    paper: Mapping[str, Sequence[float | None]] | None = None,
    xlabel: str = "",
) -> Path:
    """Bars per category and series; the paper's values (where given) as black diamonds."""
    fig, ax = _plt().subplots(figsize=(max(6.0, 0.9 * len(categories) * len(series)), 4.0))
    width = 0.8 / max(1, len(series))
    labelled_paper = False
    for i, (name, values) in enumerate(series.items()):
        xs = [c + (i - (len(series) - 1) / 2) * width for c in range(len(categories))]
        ax.bar(xs, values, width, label=f"{name} (simulated)", color=COLORS.get(name))
        marks = (paper or {}).get(name)
        if marks:
            px = [x for x, v in zip(xs, marks, strict=True) if v is not None]
            py = [v for v in marks if v is not None]
            ax.scatter(
                px,
                py,
                marker="D",
                color="black",
                s=18,
                zorder=3,
                label=None if labelled_paper else "paper (Fig. value)",
            )
            labelled_paper = True
    ax.set_xticks(range(len(categories)), categories, rotation=0)
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)
    return _finish(fig, ax, path, title, grid_axis="y")


def lines(
    path: Path,
    x: Sequence[float],
    series: Mapping[str, Sequence[float | None]],
    xlabel: str,
    ylabel: str,
    title: str,
    hline: tuple[float, str] | None = None,
) -> Path:
    """One line per series; `hline` = (y, label) draws a reference such as an SLO."""
    fig, ax = _plt().subplots(figsize=(6.4, 4.0))
    for name, ys in series.items():
        pts = [(a, b) for a, b in zip(x, ys, strict=True) if b is not None]
        if pts:
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                label=name,
                color=COLORS.get(name),
            )
    if hline is not None:
        ax.axhline(hline[0], color="grey", linestyle="--", linewidth=1, label=hline[1])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _finish(fig, ax, path, title, grid_axis="both")


def time_series(
    path: Path,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    xlabel: str,
    ylabel: str,
    title: str,
    hlines: Sequence[tuple[float, str]] = (),
) -> Path:
    """One line per series, each over its own x (e.g. time; NaN values leave gaps), without
    markers; `hlines` = (y, label) references such as the paper's values."""
    fig, ax = _plt().subplots(figsize=(6.4, 4.0))
    for name, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), linewidth=1.2, label=name, color=COLORS.get(name))
    for (y, label), style in zip(hlines, ("--", ":", "-.", "--"), strict=False):
        ax.axhline(y, color="grey", linestyle=style, linewidth=1, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _finish(fig, ax, path, title, grid_axis="both")


def stacked_bars(
    path: Path,
    categories: Sequence[str],
    parts: Mapping[str, Sequence[float]],
    ylabel: str,
    title: str,
    xlabel: str = "",
) -> Path:
    """One stacked bar per category, one segment per part (e.g. the TTFT components)."""
    fig, ax = _plt().subplots(figsize=(max(5.0, 0.8 * len(categories) + 2), 4.0))
    bottom = [0.0] * len(categories)
    for name, values in parts.items():
        ax.bar(range(len(categories)), values, 0.6, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(range(len(categories)), categories)
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)
    return _finish(fig, ax, path, title, grid_axis="y")
