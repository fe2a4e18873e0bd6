"""Oracle residuals against the paper's Fig. 7 for one candidate decode-capacity model.

A diagnostic for the next calibration, not part of `dualpath reproduce`: it runs the twelve
Fig. 7 Oracle cells of a setup (512-4,096 agents at 32K, 64K and 48K) with every GPU time
scaled by `--k` on the packaged coefficients, the HBM reserve set to `--reserve`, and at most
`--cap` sequences per decode engine (`max_seqs_per_decode_engine`; 0: no cap; default: the
packaged value). It prints the RMS log residual of the 32K and
64K columns (the ones `reproduce calibrate` fits) and of the held-out 48K column, then each
cell's residual.

    python research/oracle_fit_probe.py ds660b_2p4d --k 1.05 --cap 16
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

from dualpath.plan.runner import RunSpec
from dualpath.plan.setups import HARDWARE, setup
from dualpath.reproduce.calibrate import CALIBRATION_CELLS, HOLDOUT_CELLS, rms_of, scaled_overrides
from dualpath.reproduce.paper import fig7_point
from dualpath.sched.cost import load_cost_coefficients
from dualpath.sim import simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("setup", help="ds660b_2p4d or ds27b_1p1d")
    ap.add_argument("--k", type=float, default=1.0,
                    help="GPU-time scale on the packaged coefficients (default 1)")
    ap.add_argument("--reserve", type=float, default=None,
                    help="HBM reserve fraction (default: the packaged value)")
    ap.add_argument("--cap", type=int, default=None,
                    help="sequences per decode engine, 0: no cap (default: the packaged value)")
    args = ap.parse_args()
    base = load_cost_coefficients(setup(args.setup).model, HARDWARE)
    overrides = scaled_overrides(base, args.k, args.reserve, args.cap)
    coeffs = replace(base, **dict(overrides))  # type: ignore[arg-type]
    # The cells `reproduce calibrate` fits, then the ones it holds out.
    fit_cells = CALIBRATION_CELLS.get(args.setup, ())
    logs: dict[bool, list[float]] = {True: [], False: []}
    for agents, mal in (*fit_cells, *HOLDOUT_CELLS):
        point = fig7_point(args.setup, agents, mal)
        if point is None or "oracle" not in point.jct_s:
            continue
        cfg = RunSpec(args.setup, "oracle", agents, mal, cost_overrides=overrides).config()
        jct = simulate(cfg).jct_s
        paper = point.jct_s["oracle"]
        logs[(agents, mal) in fit_cells].append(math.log(jct / paper))
        print(f"  {agents:>5} agents {mal}: sim {jct:,.0f} s, paper {paper:,.0f} s "
              f"({100 * (jct / paper - 1):+.1f}%)", flush=True)
    fitted, held = logs[True], logs[False]
    print(f"{args.setup} k {args.k:g} reserve "
          f"{coeffs.hbm_reserve_fraction:g} cap {coeffs.max_seqs_per_decode_engine}: "
          f"RMS log residual {rms_of(fitted):.3f} "
          f"(32K and 64K), {rms_of(held):.3f} (48K, held out)")


if __name__ == "__main__":
    main()
