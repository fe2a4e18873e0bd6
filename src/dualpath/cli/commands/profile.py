"""`dualpath profile`: measure one of the runtime's engines and write a profile file that
`dualpath simulate --profile` and `dualpath advise --profile` charge instead of the roofline
cost model."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path
from typing import Any

from dualpath.cli.commands.run import _config, _model_source, add_cluster_arguments
from dualpath.core.errors import SpecError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "profile",
        help="measure an engine's step costs and write a profile for simulate/advise --profile",
        description=(
            "Time one engine of the runtime (the model of --model, on one thread, as a node "
            "runs it): prefill passes over cached and new tokens and batch size, decode steps "
            "over batch size and context, Full Block copy and store rates. Fit the step-cost "
            "model and write it with the raw timings, the model's shape, the machine, the date "
            "and the emulated cluster's run configuration (NIC rates, engines per node, engine "
            "memory: the same options and defaults as `dualpath run`) to a versioned JSON file."
        ),
    )
    add_cluster_arguments(p)
    o = p.add_argument_group("profile")
    o.add_argument("--out", type=Path, metavar="FILE",
                   help="profile file to write (default: profile-MODEL.json)")
    o.add_argument("--quick", action="store_true",
                   help="a small grid, 3 repeats (seconds on the tiny model)")
    o.add_argument("--repeats", type=int, metavar="N",
                   help="timings per point after a warm-up, the median kept (default: 3)")
    o.add_argument("--max-context", type=int, default=1536, metavar="TOKENS",
                   help="largest cached+new prompt and decode context measured "
                   "(default: %(default)s, the default `dualpath run --max-len`)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    # What `dualpath run`'s buffer sizing reads, at its defaults.
    p.set_defaults(func=run, agents=8, max_len=1536, temperature=0.0, seed=0)


def _grid(args: argparse.Namespace) -> Any:
    from dualpath.runtime.profiler import QUICK_GRID, Grid

    grid = QUICK_GRID if args.quick else Grid()
    if args.repeats is not None:
        if args.repeats < 1:
            raise SpecError("profile", "repeats", args.repeats, "must be >= 1")
        grid = Grid(**{**grid.__dict__, "repeats": args.repeats})
    if args.max_context < 64:
        raise SpecError("profile", "max_context", args.max_context, "must be >= 64")
    cap = args.max_context
    return Grid(
        prefill_cached=tuple(c for c in grid.prefill_cached if c + min(grid.prefill_new) <= cap),
        prefill_new=tuple(n for n in grid.prefill_new if n <= cap),
        prefill_batch=grid.prefill_batch,
        decode_batch=grid.decode_batch,
        decode_context=tuple(c for c in grid.decode_context if c <= cap) or (cap,),
        repeats=grid.repeats,
    )


def _machine(device: str) -> dict[str, Any]:
    import torch

    return {"hostname": platform.node(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count() or 0, "python": platform.python_version(),
            "torch": torch.__version__, "device": device}


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from dualpath.experiments.step_profile import build_profile, load_profile, write_profile
    from dualpath.runtime.model.model_source import build_model
    from dualpath.runtime.profiler import measure

    grid = _grid(args)
    cfg = _config(args, "dualpath", store="")
    source = _model_source(args)
    model = build_model(source)
    mc = model.config
    layout = model.kv_layout(cfg.block_size)
    out = args.out or Path(f"profile-{args.model if args.model in ('tiny', 'smollm2') else mc.name}"
                           ".json")
    with tqdm(total=grid.num_points, desc="profile", unit="point", file=sys.stderr,
              disable=args.no_progress) as bar:

        def tick(label: str) -> None:
            bar.set_postfix_str(label, refresh=False)
            bar.update(1)

        m = measure(model, grid, cfg.block_size, on_point=tick)
    dtype_bytes = layout.kv_bytes_per_token // (2 * mc.num_layers * mc.num_kv_heads * mc.head_dim)
    data = build_profile(
        created=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        machine=_machine(str(model.device)),
        engine={"kind": "dualpath-runtime", "source": source.kind, "device": str(model.device),
                "dtype": model.kv_dtype, "threads": m.threads, "repeats": grid.repeats},
        model={"name": mc.name, "num_layers": mc.num_layers, "hidden_size": mc.hidden_size,
               "num_attention_heads": mc.num_attention_heads, "num_kv_heads": mc.num_kv_heads,
               "head_dim": mc.head_dim, "intermediate_size": mc.intermediate_size,
               "vocab_size": mc.vocab_size, "kv_dtype_bytes": dtype_bytes,
               "weight_dtype_bytes": dtype_bytes, "is_tied_embeddings": mc.is_tied_embeddings,
               "kv_bytes_per_token": layout.kv_bytes_per_token},
        run={"storage_nic_bytes_per_s": cfg.storage_nic_bytes_per_s,
             "compute_nic_bytes_per_s": cfg.compute_nic_bytes_per_s,
             "engines_per_node": cfg.engines_per_node, "hbm_bytes": cfg.hbm_bytes,
             "dram_buffer_bytes": cfg.buffer_bytes, "block_size": cfg.block_size,
             "compute_quota_s": cfg.compute_quota_s, "beta_tokens": cfg.beta_tokens},
        prefill=m.prefill, decode=m.decode, rates=m.rates,
    )
    write_profile(out, data)
    prof = load_profile(out)
    fit = data["fit"]
    print(prof.describe())
    print(f"fit median error: prefill {fit['prefill_median_error']:.1%}, decode "
          f"{fit['decode_median_error']:.1%}; KV {layout.kv_bytes_per_token} B/token; copy "
          f"{m.rates['memory_copy'] / 2**30:.1f} GiB/s in memory, store write "
          f"{m.rates['store_write'] / 2**20:.0f} MiB/s, read {m.rates['store_read'] / 2**20:.0f} "
          "MiB/s")
    print(f"wrote {out}")
    return 0
