"""What the synchronized prefill steps look like early in an offline run (issue 26, Fig. 14):
per step, how many of the group's engines had ready work, each one's estimated attention time
against the compute quota, and the step's attention Max/Avg over the engines that ran (the
metric `SimResult.attention_ran_max_over_avg_first5` averages).

    python research/attention_steps.py [--setup ds660b_2p4d] [--agents 2048]
        [--mode dualpath] [--mal 64k] [--first-share 0.05] [--cost NAME=VALUE ...]
        [--decode-cap-at assign|decode]

Runs the pure-Python simulator (same results as the compiled one; about a minute at 2,048
agents) and wraps `Handlers._try_prefill` to read each started step; nothing is changed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import replace

os.environ["DUALPATH_PURE_PYTHON"] = "1"  # the wrapper needs the interpreted Handlers

from dualpath.plan.runner import RunSpec
from dualpath.sched import cost as costmod
from dualpath.sched.params import COMPUTE_QUOTA_S
from dualpath.sim import handlers as sim_handlers
from dualpath.sim import simulate
from dualpath.sim.config import DECODE_CAP_AT
from dualpath.sim.state import PrefillGroup


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setup", default="ds660b_2p4d")
    ap.add_argument("--agents", type=int, default=2048)
    ap.add_argument("--mode", default="dualpath")
    ap.add_argument("--mal", default="64k")
    ap.add_argument("--first-share", type=float, default=0.05,
                    help="summarize the steps started in this share of the run (default 0.05)")
    ap.add_argument("--cost", action="append", default=[], metavar="NAME=VALUE",
                    help="override a cost coefficient (`CostCoefficients`), e.g. "
                    "max_seqs_per_decode_engine=0 (no decode sequence cap); repeatable")
    ap.add_argument("--decode-cap-at", choices=DECODE_CAP_AT, default=None,
                    help="where the decode sequence cap holds a turn back "
                    "(`SimParams.decode_cap_at`; default: the simulator's, assign)")
    args = ap.parse_args(argv)
    overrides = []
    for item in args.cost:
        name, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--cost {item!r}: expected NAME=VALUE")
        number = float(value)  # an integral value stays an int (e.g. the sequence cap)
        overrides.append((name, int(number) if number.is_integer() else number))
    steps: list[tuple[float, int, list[float]]] = []
    """(start s, engines in the group, attention s of each engine that ran)."""
    original = sim_handlers.Handlers._try_prefill

    def wrapped(self: sim_handlers.Handlers, grp: PrefillGroup) -> None:
        before = self.num_prefill_steps
        now = self.loop.now_s
        original(self, grp)
        if self.num_prefill_steps == before:
            return
        cl = self.cluster
        per_engine: dict[int, list[tuple[int, int]]] = {}
        for req, n in grp.step:
            per_engine.setdefault(req.pe_engine, []).append((req.cached_tokens, n))
        steps.append((now, len(grp.engines), [
            costmod.prefill_attention_time_s(cl.model, cl.hw, pairs, cl.coeffs)
            for pairs in per_engine.values()]))

    sim_handlers.Handlers._try_prefill = wrapped  # type: ignore[method-assign]
    cfg = RunSpec(args.setup, args.mode, args.agents, args.mal,
                  cost_overrides=tuple(overrides)).config()
    if args.decode_cap_at:
        cfg = replace(cfg, params=replace(cfg.params, decode_cap_at=args.decode_cap_at))
    result = simulate(cfg)
    until = args.first_share * result.jct_s
    early = [s for s in steps if s[0] < until and s[2]]
    if not early:
        print("no prefill steps in that share of the run", file=sys.stderr)
        return 1
    ran = [len(a) for _, _, a in early]
    times = sorted(t for _, _, a in early for t in a)
    ratios = [max(a) * len(a) / sum(a) for _, _, a in early]
    wide = [r for r, (_, _, a) in zip(ratios, early, strict=True) if len(a) >= 4]
    at_quota = sum(1 for t in times if t >= 0.97 * COMPUTE_QUOTA_S)
    print(f"{args.setup} {args.mode}, {args.agents} agents, {args.mal}: JCT {result.jct_s:,.0f} s; "
          f"first {args.first_share:.0%} ({until:,.0f} s): {len(early):,} steps, "
          f"{early[0][1]} engines a group")
    print(f"  engines with work per step: median {statistics.median(ran):g}, "
          f"mean {statistics.mean(ran):.2f}; steps with one: {ran.count(1) / len(ran):.1%}")
    print(f"  attention per engine that ran: median {1e3 * statistics.median(times):.0f} ms, "
          f"p90 {1e3 * times[int(0.9 * len(times))]:.0f} ms (quota {1e3 * COMPUTE_QUOTA_S:.0f});"
          f" at the quota: {at_quota / len(times):.1%}")
    print(f"  step Max/Avg over the engines that ran: mean {statistics.mean(ratios):.3f} "
          f"(SimResult: {result.attention_ran_max_over_avg_first5:.3f}); steps with >= 4 "
          f"engines: {statistics.mean(wide) if wide else float('nan'):.3f} ({len(wide):,})")
    for t, _, a in early[:4]:
        print(f"  step at {t:.2f} s: attention per engine that ran (ms) "
              f"{', '.join(f'{1e3 * x:.0f}' for x in sorted(a))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
