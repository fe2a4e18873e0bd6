"""JCT at 1x and 3x generation, and their ratio, with `SimParams.decode_slot_hold_s` and a
sequence cap, DS 660B 2P4D 64K 1,024 agents (issue 26, Fig. 9 right):

    python research/decode_hold_modes.py HOLD_S CAP MODE[,MODE]
"""

from __future__ import annotations

import sys
from dataclasses import replace

from dualpath.plan.runner import RunSpec
from dualpath.sim import simulate


def main() -> int:
    hold, cap, modes = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
    for mode in modes:
        j1 = 0.0
        for g in (1.0, 3.0):
            spec = RunSpec("ds660b_2p4d", mode, 1024, "64k", gen_factor=g,
                           cost_overrides=(("max_seqs_per_decode_engine", cap),))
            cfg = spec.config()
            jct = simulate(replace(cfg, params=replace(cfg.params,
                                                       decode_slot_hold_s=hold))).jct_s
            j1 = j1 or jct
            print(f"{mode} hold {hold:g} cap {cap} gen {g:g}: JCT {jct:.1f} s, "
                  f"/1x {jct / j1:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
