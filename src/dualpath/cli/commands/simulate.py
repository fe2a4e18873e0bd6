"""`dualpath simulate`: run the cluster simulator on a preset cluster, model and agent trace."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from dualpath import IMPLEMENTATION
from dualpath.cli.common import (
    GB_PER_S,
    add_cluster_args,
    add_read_side_args,
    add_storage_read_arg,
    cluster_from_args,
    read_side_overrides,
    refuse_flags,
    renamed,
    storage_read_from_args,
    storage_read_line,
)
from dualpath.cli.sim_tables import SHARES_EPILOG, render_offline, render_online
from dualpath.cli.workload_args import add_workload_args, workload_from_args
from dualpath.core.errors import DualPathError
from dualpath.core.units import GB
from dualpath.plan.ray_backend import RAY_HELP, join
from dualpath.plan.runner import Runner
from dualpath.sim import (
    MODE_PRESETS,
    Driver,
    ReadDiscipline,
    SimConfig,
    SimParams,
    SimResult,
    Workload,
    mode_preset,
)
from dualpath.sim import simulate as run_sim


class SimulateArgsError(DualPathError, ValueError):
    """A bad combination of `dualpath simulate` options."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a PD-disaggregated cluster running DualPath (or a baseline) on agent traces",
        description=(
            "Discrete-event simulation of a PD-disaggregated cluster: the real dualpath.sched "
            "policies, storage/compute NICs, DRAM and HBM charged hop by hop for both KV read "
            "paths. Several --mode values run side by side: offline, their JCTs are compared; "
            "online (--online-aps), each row says why the run stopped and its latencies "
            "against the SLO."
        ),
        epilog=f"Table columns: {SHARES_EPILOG}",
    )
    add_cluster_args(p)
    w = add_workload_args(p)
    w.add_argument("--online-aps", type=float, metavar="APS",
                   help="online: Poisson agent arrivals per second (default: offline)")
    w.add_argument("--max-duration", type=float, default=3600.0, metavar="S",
                   help="online: stop after this many simulated seconds (default: %(default)s)")
    s = p.add_argument_group("simulation")
    s.add_argument(
        "--mode", action="append", metavar="MODE",
        help=f"mode(s): {', '.join(MODE_PRESETS)}; repeat or comma-separate "
        "(default: basic,dualpath,oracle)",
    )
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--profile", metavar="FILE",
                   help="charge the engine costs measured by `dualpath profile` (this file) "
                   "instead of the roofline cost model; the cluster is the profiled engine's "
                   "(its model, NIC rates, engines per node, engine memory, block size, "
                   "scheduler quota and beta), with --prefill-nodes/--decode-nodes nodes "
                   "(--model and --hardware are not used)")
    add_storage_read_arg(s)
    s.add_argument("--storage-cluster-gb-per-s", type=float, default=0.0, metavar=GB_PER_S,
                   help="aggregate read cap of the storage cluster, in GB/s (default: none)")
    for side, node in (("pe", "prefill"), ("de", "decode")):
        s.add_argument(f"--{side}-reads", metavar="fifo|shared[:N]",
                       help=f"how a {node} node's storage NIC serves its requests' reads: fifo "
                       "(one request at a time, the paper's read queue) or shared (N requests "
                       "at once splitting the NIC; no N: any number) (default: the profile's, "
                       "else fifo)")
    s.add_argument("--inference-load", type=float, default=0.0, metavar="FRACTION",
                   help="high-priority traffic share of a compute NIC during forward passes")
    s.add_argument("--prefill-ep-engines", type=int, default=0, metavar="N",
                   help="engines sharing one copy of a MoE model's weights on the prefill side "
                   "(default 0: all prefill engines)")
    s.add_argument("--decode-ep-engines", type=int, default=0, metavar="N",
                   help="the same on the decode side, where each decode step reads the shard "
                   "(default 0: all decode engines; 32 = a 2P4D unit's, as in Table 3's scale-out)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the summaries as JSON")
    o.add_argument("--csv", metavar="PATH",
                   help="per-request CSV (one file per mode: PATH with the mode inserted)")
    o.add_argument("--plot", metavar="PATH", help="PNG of per-resource utilization over time")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS",
                   help=RAY_HELP.replace("every independent simulation", "each mode"))
    add_read_side_args(s)
    refuse_flags(p, {
        "--storage-cluster-gbps": renamed("--storage-cluster-gb-per-s"),
        "--modes": "simulate spells it --mode (repeat or comma-separate)",
        "--duration": "simulate spells it --max-duration (with --online-aps)",
    })
    p.set_defaults(func=run)


def _modes(args: argparse.Namespace) -> list[str]:
    raw = args.mode or ["basic,dualpath,oracle"]
    names = [m.strip() for item in raw for m in item.split(",") if m.strip()]
    for name in names:
        mode_preset(name)  # validates, listing the valid names
    return names


def _render(args: argparse.Namespace, results: dict[str, SimResult], driver: Driver,
            workload: Workload) -> str:
    if driver.kind == "online":
        return render_online(results, driver.agents_per_s, driver.max_duration_s,
                             driver.ttft_limit_s, driver.num_agents)
    if driver.kind == "replay":
        words = f"replay of {workload.num_turns:,} requests of {args.mooncake} by their timestamps"
    else:
        words = (f"offline: {workload.num_agents} agents, {workload.num_turns:,} turns, all "
                 "starting at t = 0")
    return render_offline(results, words)


def _plot(results: dict[str, SimResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ("snic_read", "pe_cnic_read", "pe_cnic_write", "de_cnic_read", "de_cnic_write",
             "de_dram")
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.6 * len(results)), squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], results.items(), strict=True):
        for kind in kinds:
            series = r.resources[kind].series
            ax.plot([i * r.utilization_bin_s for i in range(len(series))], series, label=kind)
        ax.set_title(f"{name}: mean utilization per resource kind")
        ax.set_ylabel("utilization")
        ax.set_ylim(0, 1.05)
    axes[-1, 0].set_xlabel("simulated time (s)")
    axes[0, 0].legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _progress(bar: Any) -> Callable[[int], None]:
    def tick(n: int) -> None:
        bar.update(n)

    return tick


def _simulate_timed(cfg: SimConfig) -> tuple[SimResult, float]:
    started = time.perf_counter()
    result = run_sim(cfg)
    return result, time.perf_counter() - started


def _on_ray(address: str, configs: dict[str, SimConfig],
            progress: bool) -> dict[str, tuple[SimResult, float]]:
    """Each mode's run as a task on the Ray cluster at `address` (one that fails there runs
    here), by mode."""
    runner = Runner(ray=join(address), progress=progress)
    names = list(configs)
    out: dict[str, tuple[SimResult, float]] = {}

    def done(i: int, res: tuple[SimResult, float], node: str) -> None:
        out[names[i]] = res
        print(f"{names[i]}: ran on {node}", file=sys.stderr)

    try:
        failed = runner.fan_out(_simulate_timed, list(configs.values()), names, done)
    finally:
        assert runner.ray is not None
        runner.ray.close()
    for i in failed:
        out[names[i]] = _simulate_timed(configs[names[i]])
    return out


def run(args: argparse.Namespace) -> int:
    profile = None
    if args.profile:
        from dualpath.plan.step_profile import load_profile

        profile = load_profile(args.profile)
        cluster = profile.cluster(args.prefill_nodes, args.decode_nodes)
    else:
        cluster = cluster_from_args(args)
    modes = _modes(args)
    storage = storage_read_from_args(args)
    if args.mooncake and args.online_aps is not None:
        raise SimulateArgsError("--mooncake and --online-aps are exclusive")
    workload = workload_from_args(
        args, profile.sim_kwargs()["params"].block_size_tokens if profile else 64)
    if args.mooncake:
        driver = Driver(kind="replay")
    elif args.online_aps is not None:
        driver = Driver(kind="online", num_agents=args.agents, agents_per_s=args.online_aps,
                        max_duration_s=args.max_duration)
    else:
        driver = Driver(kind="offline", num_agents=(workload.num_agents if args.trajectories
                                                    else args.agents))
    params = SimParams(storage_cluster_bytes_per_s=args.storage_cluster_gb_per_s * GB,
                       inference_load_fraction=args.inference_load,
                       prefill_ep_engines=args.prefill_ep_engines,
                       decode_ep_engines=args.decode_ep_engines, storage_read=storage)
    if profile is None:
        base = SimConfig(cluster, workload, driver=driver, params=params, seed=args.seed)
    else:
        kw = profile.sim_kwargs()
        params = replace(kw.pop("params"),
                         storage_cluster_bytes_per_s=params.storage_cluster_bytes_per_s,
                         inference_load_fraction=params.inference_load_fraction)
        if storage is not None:
            params = replace(params, storage_read=storage)
        base = SimConfig(cluster, workload, driver=driver, params=params, seed=args.seed, **kw)
        if not args.json:
            print(f"profile: {profile.describe()}", file=sys.stderr)
    if args.pe_reads or args.de_reads:
        sp = base.params
        base = replace(base, params=replace(
            sp, pe_reads=ReadDiscipline.parse(args.pe_reads) if args.pe_reads else sp.pe_reads,
            de_reads=ReadDiscipline.parse(args.de_reads) if args.de_reads else sp.de_reads))
    base = replace(base, scheduler_overrides=read_side_overrides(args))
    if not args.json:
        print(storage_read_line(cluster, base.params.storage_read,
                                base.params.block_size_tokens), file=sys.stderr)
    configs = {name: replace(base, mode=mode_preset(name)) for name in modes}
    remote = (_on_ray(args.ray, configs, not args.no_progress and not args.json)
              if args.ray else {})
    results: dict[str, SimResult] = {}
    for name, cfg in configs.items():
        if name in remote:
            result, wall = remote[name]
        else:
            started = time.perf_counter()
            bar = None
            if not args.no_progress and not args.json:
                from tqdm import tqdm

                total = workload.num_turns if driver.kind != "online" else None
                bar = tqdm(total=total, desc=name, unit="turn", file=sys.stderr, leave=False)
            result = run_sim(cfg, _progress(bar) if bar is not None else None)
            if bar is not None:
                bar.close()
            wall = time.perf_counter() - started
        results[name] = result
        if not args.json:
            # Which build ran says how to read the wall time: the pure-Python fallback (a
            # stale or missing mypyc build, `make compile`) is 3-4x slower.
            where = "on a Ray cluster" if name in remote else f"simulator: {IMPLEMENTATION}"
            print(f"{name}: {result.num_completed} turns in {wall:.1f} s wall "
                  f"({result.num_completed / max(wall, 1e-9):,.0f} turns/s; {where})",
                  file=sys.stderr)
        if args.csv:
            path = Path(args.csv)
            result.write_csv(path.with_name(f"{path.stem}.{name}{path.suffix or '.csv'}"))
    if args.plot:
        _plot(results, args.plot)
    if args.json:
        print(json.dumps({k: r.summary() for k, r in results.items()}, indent=2))
    else:
        print(_render(args, results, driver, workload))
    return 0
