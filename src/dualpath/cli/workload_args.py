"""Workload options shared by the planning commands (`analyze`, `simulate`, `advise`): a Table-2
trace, a trajectory file, a Mooncake trace, or (`analyze` only) one turn shape."""

from __future__ import annotations

import argparse

import numpy as np

from dualpath.core.errors import DualPathError
from dualpath.sim.workload import Workload, agent_workload

TRACES = ("32k", "48k", "64k")


class WorkloadArgsError(DualPathError, ValueError):
    """A bad combination of workload options, named in one line."""


def add_workload_args(parser: argparse.ArgumentParser, default_agents: int = 64,
                      with_turn_shape: bool = False,
                      is_arrival_searched: bool = False) -> argparse._ArgumentGroup:
    """--trace, --agents, --mal, --append-scale, --gen-scale, --trajectories, --mooncake and,
    with `with_turn_shape`, --hit-ratio/--append-tokens/--gen-tokens. With
    `is_arrival_searched` (advise, which searches the agents' arrival rate), no --agents or
    --mooncake (a trace that sets its own arrivals)."""
    w = parser.add_argument_group("workload")
    w.add_argument("--trace", default="64k", choices=TRACES,
                   help="Table-2 agent trace (default: %(default)s)")
    if not is_arrival_searched:
        w.add_argument("--agents", type=int, default=default_agents,
                       help="agents (default: %(default)s)")
    w.add_argument("--mal", type=int, metavar="TOKENS", help="truncate trajectories at this MAL")
    w.add_argument("--append-scale", type=float, default=1.0, help="scale every append length")
    w.add_argument("--gen-scale", type=float, default=1.0, help="scale every generation length")
    w.add_argument("--trajectories", metavar="FILE",
                   help="the first --agents trajectories of this trajectory JSONL file "
                   "(scaled and truncated by --append-scale, --gen-scale, --mal) instead of "
                   "Table-2 agents")
    if not is_arrival_searched:
        w.add_argument("--mooncake", metavar="PATH",
                       help="a Mooncake-format trace (its requests by their timestamps) "
                       "instead of agents")
    if with_turn_shape:
        w.add_argument("--hit-ratio", type=float, metavar="R",
                       help="one turn shape instead of a trace: the share of each prompt "
                       "whose KV is stored (with --append-tokens and --gen-tokens)")
        w.add_argument("--append-tokens", type=int, metavar="N",
                       help="with --hit-ratio: new tokens per turn (the prompt is N / (1 - R))")
        w.add_argument("--gen-tokens", type=int, metavar="N",
                       help="with --hit-ratio: tokens generated per turn")
    return w


def _turn_shape(args: argparse.Namespace, block_size: int) -> Workload | None:
    ratio: float | None = getattr(args, "hit_ratio", None)
    append: int | None = getattr(args, "append_tokens", None)
    gen: int | None = getattr(args, "gen_tokens", None)
    if ratio is None and append is None and gen is None:
        return None
    if ratio is None or append is None or gen is None:
        raise WorkloadArgsError("--hit-ratio, --append-tokens and --gen-tokens go together")
    if not 0.0 <= ratio < 1.0:
        raise WorkloadArgsError(f"--hit-ratio={ratio}: must be in [0, 1)")
    if append < 1 or gen < 1:
        raise WorkloadArgsError("--append-tokens and --gen-tokens must be >= 1")
    if args.trajectories or args.mooncake:
        raise WorkloadArgsError("--hit-ratio describes the workload itself: not with "
                                "--trajectories or --mooncake")
    prompt = round(append / (1.0 - ratio))
    hit = (prompt - append) // block_size * block_size  # only Full Blocks are stored
    return Workload.from_lists([[(prompt, hit, gen)]])


def workload_from_args(args: argparse.Namespace, block_size: int = 64) -> Workload:
    """The workload the options describe (validated)."""
    shape = _turn_shape(args, block_size)
    if shape is not None:
        return shape
    if args.agents < 1:
        raise WorkloadArgsError(f"--agents={args.agents}: must be >= 1")
    if args.mooncake and args.trajectories:
        raise WorkloadArgsError("--mooncake and --trajectories are exclusive")
    if args.mooncake:
        from dualpath.workload.mooncake import load_mooncake

        return Workload.from_mooncake(load_mooncake(args.mooncake), block_size)
    if args.trajectories:
        from dualpath.workload.jsonl import load_trajectories
        from dualpath.workload.replay import scale_lengths
        from dualpath.workload.trajectory import TurnTable

        trajs = list(load_trajectories(args.trajectories).trajectories[: args.agents])
        trajs = [scale_lengths(t, args.append_scale, args.gen_scale, args.mal) for t in trajs]
        return Workload.from_turn_table(TurnTable.from_trajectories(trajs, block_size))
    return agent_workload(args.trace, args.agents, seed=getattr(args, "seed", 0),
                          max_len_tokens=args.mal, append_factor=args.append_scale,
                          gen_factor=args.gen_scale, block_size=block_size)


def describe_workload(args: argparse.Namespace, workload: Workload) -> str:
    """The workload in words: where it comes from and its turns' mean shape."""
    if getattr(args, "hit_ratio", None) is not None:
        where = "one turn shape"
    elif args.mooncake:
        where = f"Mooncake trace {args.mooncake}"
    elif args.trajectories:
        where = f"{workload.num_agents} trajectories of {args.trajectories}"
    else:
        where = f"Table-2 trace {args.trace}, {args.agents} agents"
        if args.mal:
            where += f", MAL {args.mal:,}"
    prompt = float(np.mean(workload.prompt_tokens))
    hit = float(np.mean(workload.hit_tokens))
    gen = float(np.mean(workload.gen_tokens))
    return (f"{where}: {workload.num_turns:,} turns, mean prompt {prompt:,.0f} tokens of which "
            f"{hit:,.0f} stored (hit ratio {hit / prompt:.1%}), append {prompt - hit:,.0f}, "
            f"generate {gen:,.0f}")
