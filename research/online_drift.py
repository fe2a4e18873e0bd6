"""How an online run's TTFT moves over its length, and how each judgement reads it (issue 26):
the mean TTFT of the prefills completed in each sixth of the run, the old judgement (means over
turns arriving after the first third) and the steady-state one (`plan.capacity.steady_point`).

    python research/online_drift.py [--setup ds660b_2p4d] [--mode basic] [--aps 0.3]
        [--duration 7200] [--mal 64k]

One full-size online run (DS 660B Basic at 0.3 APS over 7,200 s: about a minute here).
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np

from dualpath.plan.capacity import steady_point
from dualpath.plan.runner import RunSpec, _simulate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setup", default="ds660b_2p4d")
    ap.add_argument("--mode", default="basic")
    ap.add_argument("--aps", type=float, default=0.3)
    ap.add_argument("--duration", type=float, default=7200.0, help="simulated seconds at most")
    ap.add_argument("--mal", default="64k")
    args = ap.parse_args(argv)
    agents = math.ceil(args.aps * args.duration * 1.2) + 8  # as plan.capacity
    r, wall = _simulate(RunSpec(args.setup, args.mode, agents, args.mal, aps=args.aps,
                                max_duration_s=args.duration))
    arr, pf = r.col("arrive_s"), r.col("prefill_done_s")
    print(f"{args.setup} {args.mode} at {args.aps:g} APS: stopped at {r.duration_s:,.0f} s "
          f"({r.stop_reason}), {wall:.0f} s wall")
    sixths = []
    for k in range(6):
        lo, hi = r.duration_s * k / 6, r.duration_s * (k + 1) / 6
        m = (pf >= lo) & (pf < hi)
        sixths.append(f"{float(np.mean(pf[m] - arr[m])):.2f}" if m.any() else "-")
    print(f"  mean TTFT of the prefills completed in each sixth (s): {', '.join(sixths)}")
    late = (arr >= r.duration_s / 3.0) & (pf >= 0)
    print(f"  old judgement, turns arriving after the first third: "
          f"{float(np.mean(pf[late] - arr[late])):.2f} s")
    p = steady_point(r, args.aps)
    when = ("n/a (too short)" if p.steady_at_s is None else
            f"{p.steady_at_s:,.0f} s" if math.isfinite(p.steady_at_s) else "never")
    print(f"  steady-state judgement: TTFT {p.ttft_s:.2f} s, TPOT {1e3 * p.tpot_s:.1f} ms, "
          f"steady at {when}, meets the SLO: {'yes' if p.meets_slo else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
