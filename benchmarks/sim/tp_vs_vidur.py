"""The cost model's tensor-parallel step times against Vidur's published H100 profiles.

Vidur (microsoft/vidur) publishes per-operation GPU times of Llama-2-70B measured on H100s at
tensor-parallel sizes 1, 2, 4 and 8 (`data/profiling/compute/h100/meta-llama/Llama-2-70b-hf/
mlp.csv`: one row per (num_tokens, num_tensor_parallel_workers), each operation's time
statistics in ms) and NCCL all-reduce times on an 8-GPU H100 DGX node
(`data/profiling/network/h100_dgx/all_reduce.csv`: `size` in FP16 elements). Neither file
ships in Vidur's wheel or sdist; pass your checkout's copies (or any file in their format):

    python benchmarks/sim/tp_vs_vidur.py --mlp PATH/mlp.csv [--all-reduce PATH/all_reduce.csv]

For each row it compares the four projection GEMMs of one layer (Vidur's attn_pre_proj,
attn_post_proj, mlp_up_proj, mlp_down_proj medians) with what `dualpath.sched.cost` charges for
the same layer's linear work on an engine of that many H100s (`dgx-h100` preset, the generic
coefficients a user's Llama gets): `decode_step_time_s` at that many tokens with no context and
no overheads, less its all-reduces (`allreduce_time_s`), per layer. That is the roofline's
max(weights over HBM bandwidth, FLOPs over the linear peak), with the engine's resources summed
over its GPUs. It prints each row's error, the error of the TP scaling alone (time at TP t over
time at TP 1, ours against Vidur's: what the coefficients cannot absorb), and each all-reduce
size's error. Nothing here is fitted to these files, except that the all-reduce coefficients'
defaults were set from the all-reduce profile (docs/measurements.md).
"""

from __future__ import annotations

import argparse
import csv
import statistics
from dataclasses import replace
from pathlib import Path

from dualpath.core.hardware import hardware_preset
from dualpath.core.model import ModelSpec, dense_gqa_spec
from dualpath.sched import cost as costmod

GEMMS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
NUM_LAYERS = 80


def _model(row: dict[str, str]) -> ModelSpec:
    """The layers Vidur timed (no embeddings: it times the projections of one layer)."""
    hidden, heads = int(row["n_embd"]), int(row["n_head"])
    return dense_gqa_spec("vidur-layers", hidden=hidden, num_layers=NUM_LAYERS,
                          num_heads=heads, num_kv_heads=int(row["n_kv_head"]),
                          head_dim=hidden // heads, intermediate=int(row["n_expanded_embd"]),
                          vocab_size=0, kv_dtype_bytes=2, weight_dtype_bytes=2)


def ours_linear_ms(model: ModelSpec, tokens: int, tp: int, hardware: str) -> float:
    """The cost model's linear-layer time of one layer, in ms."""
    hw = hardware_preset(hardware).engine_view(tp)
    c = replace(costmod.coefficients_for(model, hw), per_layer_overhead_s=0.0,
                per_step_overhead_s=0.0, moe_layer_overhead_s=0.0)
    step = (costmod.decode_step_time_s(model, hw, tokens, 0.0, c)
            - costmod.allreduce_time_s(model, hw, tokens, c))
    return step / model.num_layers * 1e3


def compare_mlp(path: Path, hardware: str) -> list[tuple[int, int, float, float]]:
    """(tokens, tp, Vidur ms, ours ms) per row."""
    out = []
    with path.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            tokens, tp = int(row["num_tokens"]), int(row["num_tensor_parallel_workers"])
            vidur = sum(float(row[f"time_stats.{g}.median"]) for g in GEMMS)
            out.append((tokens, tp, vidur, ours_linear_ms(_model(row), tokens, tp, hardware)))
    return out


def compare_all_reduce(path: Path, hardware: str) -> list[tuple[int, int, float, float]]:
    """(workers, FP16 elements, Vidur ms, ours ms) per all-reduce row."""
    out = []
    with path.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if row.get("collective", "all_reduce") != "all_reduce":
                continue
            n, size = int(row["num_workers"]), int(row["size"])
            if n < 2:
                continue
            hw = hardware_preset(hardware).engine_view(n)
            model = dense_gqa_spec("one-all-reduce", hidden=size, num_layers=1, num_heads=n,
                                   num_kv_heads=n, head_dim=1, intermediate=1, vocab_size=0,
                                   kv_dtype_bytes=2, weight_dtype_bytes=2)
            c = costmod.coefficients_for(model, hw)
            # Two all-reduces per layer per token: one token of `size` hidden elements, halved.
            ours = costmod.allreduce_time_s(model, hw, 1, c) / 2 * 1e3
            out.append((n, size, float(row["time_stats.all_reduce.median"]), ours))
    return out


def _err(ours: float, ref: float) -> str:
    return f"{(ours - ref) / ref:+.0%}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mlp", type=Path, required=True, help="Vidur's mlp.csv (Llama-2-70B)")
    ap.add_argument("--all-reduce", type=Path, help="Vidur's all_reduce.csv (h100_dgx)")
    ap.add_argument("--hardware", default="dgx-h100", help="node preset (default: %(default)s)")
    args = ap.parse_args()
    rows = compare_mlp(args.mlp, args.hardware)
    tp1 = {t: v for t, tp, v, _ in rows if tp == 1}
    ours1 = {t: o for t, tp, _, o in rows if tp == 1}
    print("| tokens | TP | Vidur ms | ours ms | error | TP scaling: Vidur | ours | error |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    errors: dict[int, list[float]] = {}
    scale_errors: dict[int, list[float]] = {}
    for tokens, tp, vidur, ours in sorted(rows, key=lambda r: (r[1], -r[0])):
        errors.setdefault(tp, []).append((ours - vidur) / vidur)
        scaling = ""
        if tp > 1 and tokens in tp1:
            sv, so = vidur / tp1[tokens], ours / ours1[tokens]
            scale_errors.setdefault(tp, []).append((so - sv) / sv)
            scaling = f"{sv:.3f} | {so:.3f} | {_err(so, sv)}"
        else:
            scaling = "- | - | -"
        print(f"| {tokens} | {tp} | {vidur:.3f} | {ours:.3f} | {_err(ours, vidur)} | "
              f"{scaling} |")
    print()
    for tp in sorted(errors):
        med = statistics.median(errors[tp])
        line = (f"TP {tp}: median error {med:+.0%} over {len(errors[tp])} rows "
                f"(|error| max {max(abs(e) for e in errors[tp]):.0%})")
        if tp in scale_errors:
            line += f"; TP scaling median error {statistics.median(scale_errors[tp]):+.0%}"
        print(line)
    if args.all_reduce:
        print("\n| workers | FP16 elements | MB | Vidur ms | ours ms | error |")
        print("|---:|---:|---:|---:|---:|---:|")
        for n, size, vidur, ours in compare_all_reduce(args.all_reduce, args.hardware):
            print(f"| {n} | {size} | {2 * size / 1e6:.1f} | {vidur:.3f} | {ours:.3f} | "
                  f"{_err(ours, vidur)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
