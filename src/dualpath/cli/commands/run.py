"""`dualpath run`: replay agent trajectories on an emulated PD cluster with the real runtime."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from dualpath.cli.common import add_read_side_args
from dualpath.core.errors import DualPathError, SpecError
from dualpath.core.hardware import HARDWARE_PRESETS, hardware_preset
from dualpath.core.units import MiB, fmt_bytes
from dualpath.sched.mode import MODE_PRESETS

MODE_CHOICES = tuple(MODE_PRESETS)
"""The simulator's modes: basic, layerwise, dual-path, dualpath, split, oracle."""
DEFAULT_MODES = ("basic", "dualpath", "oracle")
"""What `--mode all` runs (the paper's baseline, DualPath and the oracle)."""

# The tiny model's KV (1 KiB/token) is small next to the cpu-emulated preset's NICs, so for it
# the NICs are scaled down (ratios kept) until storage reads bind, as in the paper's setting.
DEFAULT_IO_SCALE = {"tiny": 1 / 64, "smollm2": 1.0}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "run",
        help="replay an agentic batch on the real runtime (emulated cluster on this machine)",
        description=(
            "Start an emulated PD-disaggregated cluster on this machine (nodes are processes, "
            "NIC bandwidths are emulated by the traffic manager, KV blocks move as real bytes "
            "through storage, DRAM buffers and engines), replay agent trajectories as an "
            "offline batch in modes basic, dualpath and oracle, and report JCT, tokens/s, "
            "bytes moved per path, each node's storage-NIC read utilization and the speedups."
        ),
    )
    p.add_argument(
        "--mode",
        type=_modes,
        default=DEFAULT_MODES,
        metavar="MODE[,MODE...]",
        help=f"modes to run, comma-separated, each on an empty store: {', '.join(MODE_CHOICES)}"
        f", or all ({', '.join(DEFAULT_MODES)}; the default); e.g. the paper's ablation: "
        "basic,layerwise,dual-path,dualpath",
    )
    add_cluster_arguments(p)
    w = p.add_argument_group("workload (scaled-down synthetic trajectories)")
    w.add_argument("--workload", default="32k", help="synthetic preset: 32k, 48k, 64k")
    w.add_argument(
        "--trajectories",
        metavar="FILE",
        help="replay this trajectory JSONL file (first --agents trajectories, scaled and "
        "truncated the same way) instead of synthetic ones",
    )
    w.add_argument("--agents", type=int, default=8, help="agents (trajectories) to replay")
    w.add_argument(
        "--max-len",
        type=int,
        default=1536,
        metavar="TOKENS",
        help="MAL: truncate each trajectory at this many tokens",
    )
    w.add_argument(
        "--append-scale", type=float, default=0.25, help="multiply every appended length by this"
    )
    w.add_argument(
        "--gen-scale", type=float, default=0.05, help="multiply every generated length by this"
    )
    w.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    w.add_argument("--seed", type=int, default=0, help="workload and sampling seed")
    o = p.add_argument_group("output")
    o.add_argument(
        "--store", metavar="DIR", help="block store root (default: a fresh temp folder per mode)"
    )
    o.add_argument("--json", action="store_true", help="print the results as JSON")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _modes(text: str) -> tuple[str, ...]:
    """`--mode`'s value: mode names, comma-separated, or `all`."""
    if text == "all":
        return DEFAULT_MODES
    names = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    bad = [m for m in names if m not in MODE_PRESETS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown mode {', '.join(bad) or repr(text)} (valid: {', '.join(MODE_CHOICES)}, all)")
    return names


def add_cluster_arguments(
    p: argparse.ArgumentParser, model: str = "tiny", prefill_nodes: int = 1,
    decode_nodes: int = 2, buffer_help: str = "DRAM buffer per node, MiB (default: the "
    "preset's, raised so that every agent's longest prompt fits at once)",
) -> None:
    """The emulated cluster's options (`dualpath run` and `dualpath serve`); `_config` reads
    them."""
    g = p.add_argument_group("model and cluster")
    g.add_argument(
        "--model",
        default=model,
        help="tiny (random weights), smollm2, or a local Llama/Qwen2 checkpoint "
        "folder (default: %(default)s)",
    )
    g.add_argument("--model-seed", type=int, default=0, help="seed of the tiny model")
    g.add_argument("--prefill-nodes", type=int, default=prefill_nodes, metavar="P",
                   help="prefill nodes (default: %(default)s)")
    g.add_argument("--decode-nodes", type=int, default=decode_nodes, metavar="D",
                   help="decode nodes (default: %(default)s)")
    g.add_argument(
        "--hardware",
        default="cpu-emulated",
        help=f"node preset for NIC rates: {', '.join(HARDWARE_PRESETS)} (default: %(default)s)",
    )
    g.add_argument(
        "--engines-per-node",
        type=int,
        metavar="G",
        help="engines per node (default: the preset's GPUs per node)",
    )
    g.add_argument(
        "--io-scale",
        type=float,
        metavar="X",
        help="multiply the preset's NIC bandwidths by X (default: 1/64 for tiny, 1 otherwise)",
    )
    g.add_argument(
        "--storage-nic-mibps",
        type=float,
        metavar="MIB/S",
        help="storage NIC per node, MiB/s (overrides preset and scale)",
    )
    g.add_argument(
        "--compute-nic-mibps",
        type=float,
        metavar="MIB/S",
        help="compute NIC per engine, MiB/s (overrides preset and scale)",
    )
    g.add_argument("--buffer-mib", type=int, help=buffer_help)
    g.add_argument("--hbm-mib", type=int, default=1024, help="KV memory per decode engine, MiB")
    g.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    g.add_argument(
        "--launch",
        choices=("process", "thread"),
        default="process",
        help="nodes as processes (default) or threads of this process",
    )
    g.add_argument(
        "--transfer",
        choices=("auto", "nixl", "shm"),
        default="shm",
        help="engine-to-engine transfer engine: shm (default), nixl (NIXL/UCX) or auto (NIXL "
        "if installed); NIXL's UCX progress threads poll a core each, which on a 2-core "
        "machine slows every mode down",
    )
    add_read_side_args(g)
    g.add_argument(
        "--compute-quota-ms",
        type=float,
        default=300.0,
        metavar="MS",
        help="PE forward-pass quota of estimated time (see --estimator); requests are "
        "packed FIFO under it and the first that does not fit is chunked (default: "
        "%(default)s)",
    )
    g.add_argument(
        "--estimator",
        choices=("measured", "cost-model"),
        default="measured",
        help="PE pass-time estimator the quota applies to: measured (each prefill node times "
        "its model at start-up) or cost-model (the sched cost model, cpu-emulated preset; "
        "deterministic) (default: %(default)s)",
    )
    g.add_argument(
        "--max-batch-tokens",
        type=int,
        metavar="TOKENS",
        help="cap on the new tokens of one PE forward pass (default: the quota alone)",
    )


def _model_source(args: argparse.Namespace) -> Any:
    from dualpath.runtime.model.model_source import ModelSource

    if args.model in ("tiny", "smollm2"):
        return ModelSource(args.model, seed=args.model_seed)
    folder = Path(args.model)
    if not (folder / "config.json").is_file():
        raise SpecError(
            "run", "model", args.model, "must be tiny, smollm2 or a folder with config.json"
        )
    return ModelSource("path", path=str(folder))


def _trajectories(args: argparse.Namespace) -> list[Any]:
    from dualpath.workload.replay import scale_lengths
    from dualpath.workload.synthetic import generate, preset

    if args.agents < 1:
        raise SpecError("run", "agents", args.agents, "must be >= 1")
    if args.trajectories:
        from dualpath.workload.jsonl import load_trajectories

        source = list(load_trajectories(args.trajectories).trajectories[: args.agents])
    else:
        source = generate(preset(args.workload).with_num_trajectories(args.agents), args.seed)
    return [scale_lengths(t, args.append_scale, args.gen_scale, args.max_len) for t in source]


def _buffer_bytes(args: argparse.Namespace, preset_bytes: int) -> int:
    """--buffer-mib, else the preset's buffer raised to hold one max-length prompt per agent
    (plus slack for blocks being persisted). With every in-flight request able to hold its
    slots on both sides at once, PE and DE buffers can never wait on each other in a cycle."""
    if args.buffer_mib is not None:
        return int(args.buffer_mib * MiB)
    from dualpath.runtime.model.model_source import model_config

    layout = model_config(_model_source(args)).kv_layout(args.block_size)
    blocks_per_agent = -(-args.max_len // args.block_size) + 2
    return max(preset_bytes, int(args.agents * blocks_per_agent * layout.full_block_bytes))


def _config(args: argparse.Namespace, mode: str, store: str) -> Any:
    from dualpath.runtime.run_config import RunConfig

    hw = hardware_preset(args.hardware)
    scale = args.io_scale if args.io_scale is not None else DEFAULT_IO_SCALE.get(args.model, 1.0)
    snic = hw.storage_nic_bytes_per_s * scale
    cnic = hw.compute_nic_bytes_per_s * scale
    if args.storage_nic_mibps is not None:
        snic = args.storage_nic_mibps * MiB
    if args.compute_nic_mibps is not None:
        cnic = args.compute_nic_mibps * MiB
    return RunConfig(
        mode=mode,
        store_root=store,
        model=_model_source(args),
        num_prefill_nodes=args.prefill_nodes,
        num_decode_nodes=args.decode_nodes,
        engines_per_node=(hw.gpus_per_node if args.engines_per_node is None
                          else args.engines_per_node),
        storage_nic_bytes_per_s=snic,
        compute_nic_bytes_per_s=cnic,
        buffer_bytes=_buffer_bytes(args, hw.dram_buffer_bytes),
        hbm_bytes=args.hbm_mib * MiB,
        block_size=args.block_size,
        transfer_kind=args.transfer,
        launch=args.launch,
        temperature=args.temperature,
        seed=args.seed,
        read_tie_side=args.read_tie_side,
        rr_read_side=args.rr_read_side,
        compute_quota_s=args.compute_quota_ms / 1000.0,
        max_batch_tokens=args.max_batch_tokens,
        estimator=args.estimator,
    )


def _run_mode(args: argparse.Namespace, mode: str, trajectories: list[Any]) -> Any:
    from tqdm import tqdm

    from dualpath.runtime.agent_replay import agents_from_trajectories, replay
    from dualpath.runtime.emulated_cluster import Cluster

    with tempfile.TemporaryDirectory(prefix=f"dualpath-{mode}-") as tmp:
        store = str(Path(args.store) / mode) if args.store else tmp
        cfg = _config(args, mode, store)
        cluster = Cluster(cfg)
        try:
            agents = agents_from_trajectories(trajectories, cluster.vocab_size, args.seed)
            total = sum(len(a.appends) for a in agents)
            with tqdm(
                total=total,
                desc=f"{mode:>8}",
                unit="turn",
                leave=False,
                disable=args.no_progress or args.json,
            ) as bar:
                return replay(cluster, agents, on_turn=lambda _r: bar.update(1))
        finally:
            cluster.close()


def render(results: dict[str, Any]) -> str:
    """The human-readable report of one or more modes."""
    first = next(iter(results.values()))
    cfg = first.config
    lines = [
        f"dualpath run: {cfg.num_prefill_nodes}P{cfg.num_decode_nodes}D x "
        f"{cfg.engines_per_node} engines/node, model {cfg.model.kind}, "
        f"SNIC {fmt_bytes(cfg.storage_nic_bytes_per_s)}/s per node, "
        f"CNIC {fmt_bytes(cfg.compute_nic_bytes_per_s)}/s per engine, "
        f"{len(first.turns)} turns",
        "",
        f"  {'mode':<9} {'JCT':>8} {'tok/s':>9} {'gen':>6} {'hit':>6} {'PE read':>10} "
        f"{'DE read':>10} {'PE->DE':>10} {'DE->PE':>10} {'persist':>10}  SNIC read util",
    ]
    for mode, r in results.items():
        b = r.bytes_by_path()
        util = " ".join(f"n{n}:{u:.0%}" for n, u in sorted(r.snic_read_utilization().items()))
        hit = r.num_hit_tokens / max(1, r.num_prompt_tokens)
        lines.append(
            f"  {mode:<9} {r.jct_s:>7.2f}s {r.tokens_per_s:>9,.0f} "
            f"{r.num_generated_tokens:>6} {hit:>6.1%} "
            f"{fmt_bytes(b.get('pe_read', 0)):>10} {fmt_bytes(b.get('de_read', 0)):>10} "
            f"{fmt_bytes(b.get('pe_to_de', 0)):>10} {fmt_bytes(b.get('de_to_pe', 0)):>10} "
            f"{fmt_bytes(b.get('snic_write', 0)):>10}  {util}"
        )
    lines.append("")
    for mode, r in results.items():
        c = r.engine_counters()
        passes = c.get("num_prefill_passes", 0)
        entries = c.get("num_prefill_entries", 0)
        lines.append(
            f"  {mode:<9} PE forward passes {passes}, {entries / max(1, passes):.2f} "
            f"requests or chunks per pass, {c.get('num_chunked_entries', 0)} chunks; "
            f"scheduler answered {r.num_fetches} fetches"
        )
        for n in r.nodes:
            if n.estimator:
                lines.append(f"  {'':<9} PE estimator of node {n.node}: {n.estimator}")
    lines.append("")
    others = [m for m in results if m != "basic"]
    if "basic" in results and others:
        lines.append("  speedup vs basic (JCT): " + ", ".join(
            f"{m} {results['basic'].jct_s / results[m].jct_s:.2f}x" for m in others))
    if "oracle" in results and "dualpath" in results:
        lines.append(
            f"  oracle vs dualpath (JCT): "
            f"{results['dualpath'].jct_s / results['oracle'].jct_s:.2f}x "
            f"(dualpath reaches {results['oracle'].jct_s / results['dualpath'].jct_s:.0%}"
            f" of the oracle)"
        )
    same = (
        len({tuple(sorted((k, tuple(v)) for k, v in r.outputs.items())) for r in results.values()})
        == 1
    )
    if len(results) > 1:
        lines.append(f"  outputs identical across modes: {'yes' if same else 'NO'}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    modes: tuple[str, ...] = args.mode
    trajectories = _trajectories(args)
    results = {}
    for mode in modes:
        try:
            results[mode] = _run_mode(args, mode, trajectories)
        except DualPathError:
            raise
        r = results[mode]
        if r.num_unpersisted_blocks:
            print(f"dualpath run: warning: {mode}: {r.num_unpersisted_blocks} KV blocks could not "
                  "be persisted (the store's writes failed, see above); later turns recomputed "
                  "them", file=sys.stderr, flush=True)
        if not args.json and not args.no_progress:
            print(f"{mode}: JCT {r.jct_s:.2f} s, {r.tokens_per_s:,.0f} tokens/s", flush=True)
    if args.json:
        out = {m: r.to_dict() for m, r in results.items()}
        if "basic" in results:
            out["speedup_vs_basic"] = {m: results["basic"].jct_s / r.jct_s
                                       for m, r in results.items() if m != "basic"}
        if "basic" in results and "dualpath" in results:
            out["speedup_dualpath_vs_basic"] = results["basic"].jct_s / results["dualpath"].jct_s
        if "oracle" in results and "dualpath" in results:
            out["oracle_vs_dualpath"] = results["dualpath"].jct_s / results["oracle"].jct_s
        print(json.dumps(out, indent=2))
    else:
        print(render(results))
    return 0
