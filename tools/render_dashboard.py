"""Draw the Grafana dashboard's panels from series a real Prometheus scraped (matplotlib).

    DUALPATH_DASHBOARD_DATA=out/dashboard.json make vllm-test   # or the one test:
    DUALPATH_DASHBOARD_DATA=out/dashboard.json .venv-vllm/bin/python -m pytest \\
        tests/integrations/vllm/test_packaged_plugin.py
    .venv/bin/python tools/render_dashboard.py out/dashboard.json --out out/dashboard.png

`tests/integrations/vllm/test_packaged_plugin.py` writes the file: every target's PromQL
expression of deploy/grafana/dualpath.json with its range-query result over the test's last
40 s (`$__rate_interval` filled in). Each panel here is drawn with its title, its targets'
legends and its unit, in the dashboard's order; a picture of what the dashboard shows, not
Grafana's rendering.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "deploy" / "grafana" / "dualpath.json"
COLUMNS = 4


def legend(template: str, labels: dict[str, str]) -> str:
    """Grafana's `{{label}}` legend format filled in."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def render(dashboard: dict[str, Any], data: dict[str, Any], out: Path) -> int:
    """One subplot per time-series panel; returns how many were drawn."""
    rate = data["rate_interval"]
    series: dict[str, list[dict[str, Any]]] = data["series"]
    panels = [p for p in dashboard["panels"] if p.get("type") == "timeseries"]
    rows = -(-len(panels) // COLUMNS)
    fig, axes = plt.subplots(rows, COLUMNS, figsize=(4.2 * COLUMNS, 2.9 * rows), squeeze=False)
    t0 = min((float(v[0]) for s in series.values() for one in s for v in one["values"]),
             default=0.0)
    for ax, panel in zip(axes.flat, panels, strict=False):
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", rate)
            for one in series.get(expr, []):
                xs = [float(v[0]) - t0 for v in one["values"]]
                ys = [float(v[1]) for v in one["values"]]
                ax.plot(xs, ys, label=legend(target.get("legendFormat", ""), one["metric"]))
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        ax.set_title(panel["title"], fontsize=8)
        ax.set_ylabel(unit, fontsize=7)
        ax.tick_params(labelsize=6)
        ax.set_xlabel("s", fontsize=6)
        if ax.lines:
            ax.legend(fontsize=5, loc="upper left")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{dashboard['title']}: {len(panels)} panels over a 1P1D on CPU "
                 "(SmolLM2, split mode), scraped by Prometheus", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    return len(panels)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", type=Path, help="the scraped series (DUALPATH_DASHBOARD_DATA)")
    ap.add_argument("--dashboard", type=Path, default=DASHBOARD)
    ap.add_argument("--out", type=Path, default=Path("out/dashboard.png"))
    args = ap.parse_args()
    n = render(json.loads(args.dashboard.read_text()), json.loads(args.data.read_text()),
               args.out)
    print(f"wrote {args.out} ({n} panels)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
