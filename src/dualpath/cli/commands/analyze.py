"""`dualpath analyze`: the paper's bottleneck-free P/D analysis for your cluster."""

from __future__ import annotations

import argparse
import json
from fractions import Fraction

from dualpath.cli.common import add_cluster_args, cluster_from_args
from dualpath.core.analysis import Analysis, analyze
from dualpath.core.cluster import ClusterSpec
from dualpath.core.units import fmt_bytes, fmt_rate


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "analyze",
        help="bottleneck-free P/D range and per-resource load of a cluster (paper §4.2)",
        description=(
            "Charge every hop of DualPath's two read paths to the NICs and DRAM that carry it, "
            "with every storage NIC reading at full rate, and report each resource's "
            "utilization, the bottleneck-free range of P/D, whether your P/D is inside it, and "
            "outside it which resource binds and by how much."
        ),
    )
    add_cluster_args(p)
    p.add_argument("--json", action="store_true", help="print the analysis as JSON")
    p.set_defaults(func=run)


def _frac(x: float) -> str:
    if x in (float("inf"), float("-inf")):
        return "inf"
    f = Fraction(x).limit_denominator(64)
    if abs(float(f) - x) < 1e-9 and f.denominator != 1:
        return f"{f} ({x:.3g})"
    return f"{x:.3g}"


def render(a: Analysis, cluster: ClusterSpec) -> str:
    """The human-readable report."""
    hw = cluster.hardware
    r = a.range
    lines = [
        f"Bottleneck-free analysis (paper §4.2): {hw.name}, {cluster.label} "
        f"(P/D = {_frac(a.pd_ratio)})",
        f"  g = {hw.gpus_per_node} GPUs/node, B = {fmt_rate(hw.compute_nic_bytes_per_s)} per CNIC, "
        f"s*B = {fmt_rate(hw.storage_nic_bytes_per_s)} per SNIC (s = {a.s:.3g}), "
        f"M = {fmt_rate(hw.dram_bytes_per_s)}",
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
        f"  storage reads: DualPath {fmt_rate(a.storage_read_bytes_per_s)} "
        f"({tok_s:,.0f} tokens/s of {cluster.model.name} KV at {fmt_bytes(kv)}/token) vs "
        f"PE-only {fmt_rate(a.basic_storage_read_bytes_per_s)} ({basic_tok_s:,.0f} tokens/s): "
        f"{a.storage_read_bytes_per_s / a.basic_storage_read_bytes_per_s:.2f}x"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    cluster = cluster_from_args(args)
    a = analyze(cluster.hardware, cluster.num_prefill_nodes, cluster.num_decode_nodes)
    if args.json:
        out = a.to_dict()
        out["model"] = cluster.model.name
        out["kv_bytes_per_token"] = cluster.model.kv_bytes_per_token
        print(json.dumps(out, indent=2, default=str))
    else:
        print(render(a, cluster))
    return 0
