"""`dualpath analyze`: the paper's bottleneck-free P/D analysis for your cluster, and whether
your workload on it is storage-bound (what DualPath's second read path is for)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from fractions import Fraction

from dualpath.cli.common import (
    add_cluster_args,
    add_storage_read_arg,
    cluster_from_args,
    storage_read_from_args,
)
from dualpath.cli.workload_args import add_workload_args, describe_workload, workload_from_args
from dualpath.core.analysis import Analysis, analyze
from dualpath.core.cluster import ClusterSpec
from dualpath.core.units import fmt_bytes, fmt_rate
from dualpath.plan.storage_bound import StorageBound, storage_bound


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "analyze",
        help="is a cluster storage-bound on a workload, and its bottleneck-free P/D range "
        "(paper §4.2)",
        description=(
            "Two answers without simulating. (1) Is the cluster storage-bound on the workload: "
            "the turn rate its storage NICs sustain with one read path (the prefill side's) "
            "and with two (DualPath), against what its prefill and decode engines sustain "
            "(the cost model), and in one line whether DualPath is worth it. (2) The paper's "
            "bottleneck-free analysis: every hop of both read paths charged to the NICs and "
            "DRAM that carry it, with every storage NIC at full rate; each resource's "
            "utilization, the bottleneck-free range of P/D, and whether your P/D is inside it."
        ),
    )
    add_cluster_args(p)
    add_workload_args(p, with_turn_shape=True)
    s = p.add_argument_group("storage")
    add_storage_read_arg(s)
    p.add_argument("--json", action="store_true", help="print the analysis as JSON")
    p.set_defaults(func=run)


def _frac(x: float) -> str:
    if x in (float("inf"), float("-inf")):
        return "inf"
    f = Fraction(x).limit_denominator(64)
    if abs(float(f) - x) < 1e-9 and f.denominator != 1:
        return f"{f} ({x:.3g})"
    return f"{x:.3g}"


def _engines_line(cluster: ClusterSpec) -> str:
    node, eng = cluster.hardware, cluster.engine_hardware
    tp = cluster.tensor_parallel_size
    if tp == 1:
        return (f"  g = {node.gpus_per_node} GPUs (engines)/node, "
                f"B = {fmt_rate(node.compute_nic_bytes_per_s)} per CNIC")
    return (f"  g = {eng.gpus_per_node} engines/node of {tp} GPUs each (TP {tp}), "
            f"B = {fmt_rate(eng.compute_nic_bytes_per_s)} per engine "
            f"({tp} x {fmt_rate(node.compute_nic_bytes_per_s)} CNICs)")


def render(a: Analysis, cluster: ClusterSpec) -> str:
    """The bottleneck-free analysis, human-readable."""
    hw = cluster.engine_hardware
    r = a.range
    lines = [
        f"Bottleneck-free analysis (paper §4.2): {hw.name}, {cluster.label} "
        f"(P/D = {_frac(a.pd_ratio)})",
        f"{_engines_line(cluster)}, s*B = {fmt_rate(hw.storage_nic_bytes_per_s)} per SNIC "
        f"(s = {a.s:.3g}), M = {fmt_rate(hw.dram_bytes_per_s)}",
        f"  per-pair traffic: T_p = {fmt_rate(a.t_p_bytes_per_s)} (PE path), "
        f"T_c = {fmt_rate(a.t_c_bytes_per_s)} (DE path)",
        "",
        f"  range: s/(g-s) = {_frac(r.lower)} <= P/D <= "
        f"min{{ (g-2s)/s = {_frac(r.upper_de_cnic_read)}, "
        f"(g-s)/(2s) = {_frac(r.upper_de_cnic_write)}, (M/(Bs)-3)/2 = {_frac(r.upper_de_dram)} }}"
        f" = {_frac(r.upper)}",
        f"  read direction 2s/g = {2 * a.s / hw.gpus_per_node:.3g} <= 1 (needs s <= g/2): "
        f"{'ok' if r.pe_read_ok else 'VIOLATED'}",
        "",
        f"  {'resource':<52} {'load':>11} {'capacity':>11} {'util':>7}  condition",
    ]
    for c in a.constraints:
        flag = "" if c.is_ok else "  <-- over"
        lines.append(
            f"  {c.resource:<52} {fmt_rate(c.load_bytes_per_s):>11} "
            f"{fmt_rate(c.capacity_bytes_per_s):>11} {c.utilization:>6.1%}  {c.bound}{flag}"
        )
    lines.append("")
    kv = cluster.model.kv_bytes_per_token
    tok_s = a.storage_read_bytes_per_s / kv
    basic_tok_s = a.basic_storage_read_bytes_per_s / kv
    if a.is_bottleneck_free:
        lines.append(
            f"  verdict: {cluster.label} is inside the range; every storage NIC can read at full "
            f"rate. Most loaded resource: {a.binding.name} at {a.binding.utilization:.0%}."
        )
    else:
        b = a.binding
        lines.append(
            f"  verdict: {cluster.label} is OUTSIDE the range: {b.resource} would need "
            f"{b.utilization:.2f}x its bandwidth, so storage reads are capped at "
            f"{a.storage_read_fraction:.0%} of the storage NICs' aggregate."
        )
    lines.append(
        f"  storage reads at line rate: DualPath {fmt_rate(a.storage_read_bytes_per_s)} "
        f"({tok_s:,.0f} tokens/s of {cluster.model.name} KV at {fmt_bytes(kv)}/token) vs "
        f"PE-only {fmt_rate(a.basic_storage_read_bytes_per_s)} ({basic_tok_s:,.0f} tokens/s): "
        f"{a.storage_read_bytes_per_s / a.basic_storage_read_bytes_per_s:.2f}x"
    )
    return "\n".join(lines)


def render_bound(b: StorageBound, cluster: ClusterSpec, workload: str) -> str:
    """Whether the workload is storage-bound on the cluster, human-readable."""
    rate = b.read_bytes_per_s_per_node
    nominal = cluster.hardware.storage_nic_bytes_per_s
    how = (f"the line rate: {cluster.hardware.name} has no calibrated storage record, so this "
           "is an upper bound (the paper's 3FS reads about half of it: try --storage-read "
           "queued or flat:0.5)" if b.is_line_rate
           else f"{rate / nominal:.2f} of the {fmt_rate(nominal)} line rate")
    rows = [
        ("storage NICs, prefill nodes only (one path)", b.one_path.storage_turns_per_s),
        ("storage NICs, every node (two paths, DualPath)", b.two_paths.storage_turns_per_s),
        (f"prefill engines ({cluster.num_prefill_engines})", b.prefill_turns_per_s),
        (f"decode engines ({cluster.num_decode_engines})", b.decode_turns_per_s),
    ]
    lines = [
        f"Is {cluster.label} storage-bound? {cluster.model.name} on {workload}",
        f"  per turn: {fmt_bytes(b.read_bytes_per_turn)} of stored KV to read; a storage NIC "
        f"reads {fmt_rate(rate)}, {how}",
        f"  per turn: {b.prefill_engine_s_per_turn * 1e3:.3g} ms of a prefill engine, "
        f"{b.decode_engine_s_per_turn * 1e3:.3g} ms of a decode engine (holding "
        f"{b.mean_decode_batch:,.0f} sequences)",
        "",
        f"  {'resource':<48} {'turns/s it sustains':>20}",
    ]
    lines += [f"  {name:<48} {tps:>20.3g}" for name, tps in rows]
    lines.append("")
    for bound in (b.one_path, b.two_paths):
        lines.append(
            f"  {bound.name + ':':<31} {bound.turns_per_s:.3g} turns/s, {bound.binding}-bound; "
            f"{b.storage_wait_share(bound):.0%} of the GPUs' rate lost waiting on storage")
    lines.append(f"  verdict: {b.verdict()}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    cluster = cluster_from_args(args)
    workload = workload_from_args(args)
    storage = storage_read_from_args(args)
    a = analyze(cluster.engine_hardware, cluster.num_prefill_nodes, cluster.num_decode_nodes)
    b = storage_bound(cluster, workload.prompt_tokens, workload.hit_tokens, workload.gen_tokens,
                      storage)
    words = describe_workload(args, workload)
    if args.json:
        out = a.to_dict()
        out["model"] = cluster.model.name
        out["tensor_parallel_size"] = cluster.tensor_parallel_size
        out["kv_bytes_per_token"] = cluster.model.kv_bytes_per_token
        out["workload"] = words
        out["storage_bound"] = {**asdict(b), "hit_ratio": b.hit_ratio, "gain": b.gain,
                                "verdict": b.verdict()}
        print(json.dumps(out, indent=2, default=str))
    else:
        print(render_bound(b, cluster, words))
        print()
        print(render(a, cluster))
    return 0
