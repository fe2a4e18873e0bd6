"""`dualpath advise`: sweep P/D and modes in the simulator, recommend the best SLO capacity per
GPU, with the runner-up and each configuration's bottleneck."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

from dualpath.cli.common import (
    add_cluster_args,
    add_storage_read_arg,
    cluster_from_args,
    out_dir,
    refuse_flags,
    storage_read_from_args,
)
from dualpath.cli.workload_args import add_workload_args
from dualpath.core.errors import DualPathError
from dualpath.core.hardware import hardware_preset
from dualpath.plan.advise import advise, storage_words
from dualpath.plan.deploy import deployment, render
from dualpath.plan.ray_backend import RAY_HELP, join
from dualpath.plan.runner import Runner, RunSpec, mal_tokens
from dualpath.plan.section import Context, section_markdown
from dualpath.plan.setups import HARDWARE, PROFILE_PREFIX, SETUPS, setup
from dualpath.plan.step_profile import load_profile
from dualpath.plan.user_setup import WorkloadSpec, write_user_setup
from dualpath.sched.cost import coefficients_for
from dualpath.sim import MODE_PRESETS, SimResult, mode_preset


class AdviseArgsError(DualPathError, ValueError):
    """A bad `dualpath advise` option."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "advise",
        help="recommend a P/D ratio and mode for your model, hardware and trace (simulated), "
        "and print the commands that deploy it",
        description=(
            "For each P/D and mode, find the highest agent arrival rate (APS) that meets the "
            "SLO (mean TTFT <= 4 s, mean TPOT <= 50 ms) in online simulations; rank by APS per "
            "GPU; print the recommendation, the runner-up and each configuration's bottleneck, "
            "then the vLLM and router commands that run the recommended cluster as simulated "
            "(its engines, tensor-parallel size and staging buffers), each non-default setting "
            "with its reason. The cluster and workload options are simulate's."
        ),
    )
    add_cluster_args(p, default_model="ds-27b", default_hardware=HARDWARE, with_nodes=False)
    add_workload_args(p, is_arrival_searched=True)
    p.add_argument("--pd", default="1P1D,2P1D,1P2D", metavar="LIST",
                   help="P/D configurations in nodes, e.g. 1P1D,2P1D (default: %(default)s)")
    p.add_argument("--modes", default="basic,dualpath", metavar="LIST",
                   help=f"modes to compare: {', '.join(MODE_PRESETS)} (default: %(default)s)")
    p.add_argument("--steps", type=int, default=2, help="bisection steps (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="600 s simulated runs instead of 7,200")
    p.add_argument("--duration", type=float, default=0.0, metavar="S",
                   help="simulated seconds per online run (default: 600 quick, 7,200 full)")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for advise.csv, section_advise.md and the planned cluster's "
                   "cluster.json (default: $DUALPATH_OUT/advise, else out/advise)")
    p.add_argument("--jobs", type=int, default=0, metavar="N",
                   help="capacity searches run in N processes (default: the machine's cores); "
                   "results are identical to a serial run")
    p.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS", help=RAY_HELP)
    p.add_argument("--quiet", action="store_true", help="no per-run progress lines or bar")
    add_storage_read_arg(p)
    p.add_argument("--profile", metavar="FILE",
                   help="simulate the engine measured by `dualpath profile` (this file): its "
                   "step costs instead of the roofline model, its model and run configuration "
                   "(the cluster options are not used)")
    d = p.add_argument_group("deployment commands printed for the recommendation")
    d.add_argument("--vllm-model", default="MODEL_DIR", metavar="DIR",
                   help="the model folder each vLLM server loads (default: %(default)s)")
    d.add_argument("--store", default="/mnt/dualpath-kv", metavar="DIR",
                   help="the block store every node and the router mount (default: %(default)s)")
    d.add_argument("--vllm-python", default="python3", metavar="EXE",
                   help="the interpreter of the venv with vLLM on the nodes (default: "
                   "%(default)s)")
    refuse_flags(p, {
        "--agents": "advise searches the agents' arrival rate (APS) itself; it takes no "
                    "--agents",
        "--online-aps": "advise searches the APS itself; simulate --online-aps runs one",
        "--max-duration": "advise spells it --duration",
        "--mooncake": "a Mooncake trace sets its own arrivals, and advise searches them: "
                      "dualpath simulate --mooncake replays one",
    })
    p.set_defaults(func=run)


def _setup_name(args: argparse.Namespace, pd: tuple[int, int]) -> str:
    """The planning setup of the cluster and workload options: a paper setup or a preset pair
    where the options name nothing more, else the user's own (`plan.user_setup`), written to
    `--out`/cluster.json."""
    cluster = cluster_from_args(args, *pd)
    workload = WorkloadSpec(str(Path(args.trajectories).resolve()) if args.trajectories else "",
                            args.append_scale, args.gen_scale)
    is_preset = (not args.model_config and cluster.tensor_parallel_size == 1
                 and cluster.hardware == hardware_preset(args.hardware) and workload.is_default)
    if is_preset:
        known = {(s.model, s.hardware): s.name for s in SETUPS.values()}
        return known.get((args.model, args.hardware), f"{args.model}@{args.hardware}")
    return write_user_setup(args.out / "cluster.json", cluster, workload)


_PD = re.compile(r"^(\d+)P(\d+)D$", re.IGNORECASE)


def parse_pd(text: str) -> list[tuple[int, int]]:
    """`1P1D,2P1D` -> [(1, 1), (2, 1)]; errors name the bad item."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        m = _PD.match(item)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise AdviseArgsError(f"--pd item {item!r}: expected like 2P4D with P, D >= 1")
        out.append((int(m.group(1)), int(m.group(2))))
    if not out:
        raise AdviseArgsError("--pd: no configurations given")
    return out


def run(args: argparse.Namespace) -> int:
    if args.out is None:
        args.out = out_dir("advise")
    pds = parse_pd(args.pd)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        mode_preset(m)
    if args.steps < 0:
        raise AdviseArgsError(f"--steps={args.steps}: must be >= 0")
    storage = storage_read_from_args(args)
    prof = None
    if args.profile:
        name = f"{PROFILE_PREFIX}{args.profile}"
        setup(name)  # reads and checks the file now: a bad one is one line naming the field
        prof = load_profile(args.profile)
    else:
        name = _setup_name(args, pds[0])

    runner = Runner(jobs=args.jobs or os.cpu_count() or 1, progress=not args.quiet)

    def on_run(spec: RunSpec, res: SimResult, wall: float) -> None:
        if args.quiet:
            return
        # The setup's own P/D is stored as 0/0 (one cache key); print the cluster run.
        cl = setup(spec.setup).cluster(spec.num_prefill_nodes or None,
                                       spec.num_decode_nodes or None)
        node = runner.node_of.get(spec)
        print(f"  {cl.num_prefill_nodes}P{cl.num_decode_nodes}D {spec.mode:<9} "
              f"{spec.aps:.3f} APS: {res.num_completed} turns, {res.stop_reason}, "
              f"{wall:.1f} s wall" + (f" on {node}" if node else ""), file=sys.stderr,
              flush=True)

    runner.on_run = on_run
    if args.duration < 0:
        raise AdviseArgsError(f"--duration={args.duration}: must be >= 0")
    if args.jobs < 0:
        raise AdviseArgsError(f"--jobs={args.jobs}: must be >= 0 (0: the machine's cores)")
    engine: dict[str, Any] = dict(prof.data["engine"]) if prof is not None else {}
    is_vllm = engine.get("kind") == "vllm"
    mal = args.mal if args.mal is not None else (engine.get("max_model_len") if is_vllm
                                                 else None)
    trace = args.trace if mal is None else f"{args.trace}@{mal}"
    mal_tokens(trace)  # a bad --mal is one line
    ctx = Context(args.out, runner, args.quick, mals=(trace,),
                  online_duration_s=args.duration, storage_read=storage)
    print(storage_words(ctx, name), file=sys.stderr)
    if args.ray:
        runner.ray = join(args.ray)
    try:
        cands, section = advise(ctx, name, pds, modes, args.steps)
    finally:
        if runner.ray is not None:
            runner.ray.close()
    md = ctx.path("section_advise.md")
    md.write_text(section_markdown(section, ctx.out_dir) + "\n", encoding="utf-8")
    best = cands[0]
    print(f"recommended: {best.label}: {best.capacity_text} APS under the SLO on "
          f"{best.num_gpus} GPUs ({1e3 * best.aps_per_gpu:.2f} mAPS/GPU); bottleneck: "
          f"{best.bottleneck}")
    if len(cands) > 1:
        r = cands[1]
        print(f"runner-up:   {r.label}: {r.capacity_text} APS on {r.num_gpus} GPUs "
              f"({1e3 * r.aps_per_gpu:.2f} mAPS/GPU); bottleneck: {r.bottleneck}")
    for c in cands[2:]:
        print(f"             {c.label}: {c.capacity_text} APS ({1e3 * c.aps_per_gpu:.2f} "
              f"mAPS/GPU); bottleneck: {c.bottleneck}")
    print(f"wrote {md} and {ctx.path('advise.csv')}")
    cluster = setup(name).cluster(best.num_prefill_nodes, best.num_decode_nodes)
    # A vLLM profile's engine settings are those of the server measured: its commands run
    # the engine the plan was simulated with.
    measured: dict[str, Any] = {}
    if prof is not None and is_vllm:
        measured = {k: engine[k] for k in ("dtype", "max_model_len", "max_num_seqs")
                    if k in engine}
        if "enforce_eager" in engine:
            measured["cuda_graphs"] = not engine["enforce_eager"]
        measured["staging_blocks"] = max(1, round(prof.run["dram_buffer_bytes"] / (
            prof.run["block_size"] * prof.model["kv_bytes_per_token"])))
        measured["measured_tp"] = int(engine.get("tensor_parallel_size", 1))
    else:
        seqs = coefficients_for(cluster.model, cluster.engine_hardware).max_seqs_per_decode_engine
        measured = {"max_model_len": mal_tokens(trace)[1], "max_num_seqs": seqs}
    plan = deployment(cluster, model=args.vllm_model, store=args.store, mode=best.mode,
                      python=args.vllm_python,
                      context_why=f"the longest context the plan simulated (trace {trace})",
                      **measured)
    print(f"\ndeploy {best.label} as simulated: {cluster.num_nodes} nodes of "
          f"{cluster.hardware.gpus_per_node} GPUs, {cluster.engines_per_node} engine(s) per node "
          f"(replace prefill-N / decode-N with your hosts' names; every node and the router "
          f"mount the block store at {args.store}):")
    print(render(plan))
    if runner.ray is not None:
        print(f"simulated {len(runner.log)} runs on Ray: {runner.where() or 'none'}")
    for f in runner.failures:
        print(f"failed on the cluster, then run here: {f.name} ({f.error})")
    return 0
