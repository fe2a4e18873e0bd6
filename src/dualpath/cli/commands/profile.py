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
from dualpath.cli.common import GB_PER_S, refuse_flags, renamed
from dualpath.core.errors import SpecError
from dualpath.core.units import GB


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "profile",
        help="measure an engine's step costs and write a profile for simulate/advise --profile",
        description=(
            "Time one engine of the runtime (the model of --model, on one thread, as a node "
            "runs it): prefill passes over cached and new tokens and batch size, decode steps "
            "over batch size and context, Full Block copy and store rates; then time a few "
            "turns of one agent, one at a time, through an emulated cluster of the run "
            "configuration with unpaced I/O, for the control plane's per-turn latency beyond "
            "the step costs. Fit the step-cost "
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
    o.add_argument("--turns", type=int, metavar="N",
                   help="turns timed through an emulated cluster for the control plane's "
                   "per-turn latency (run.control_plane; after 2 untimed ones; 0: not "
                   "measured, none in the file) (default: 12, 3 with --quick; about 12 s on "
                   "the tiny model here, mostly the cluster's start)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    v = p.add_argument_group(
        "vLLM (--engine vllm)",
        "Time a vLLM server through timed /v1/completions requests (token-id prompts of "
        "chosen lengths and batch sizes; cached tokens through vLLM's prefix cache): --url "
        "names a running one (started with --enable-prefix-caching), else one is started "
        "with --vllm-python on --model (a folder, or smollm2: the converted SmolLM2) on the "
        "cores one instance of a 1P1D cluster gets here. --model gives the model's shape "
        "either way. The run configuration recorded is the vLLM P/D cluster's "
        "(benchmarks/vllm/vllm_pd_bench.py): one instance per node, its storage NIC, staging "
        "buffer and KV cache.")
    v.add_argument("--engine", choices=("runtime", "vllm"), default="runtime",
                   help="what to profile (default: %(default)s: one of the runtime's engines)")
    v.add_argument("--url", metavar="URL", help="a running vLLM server (default: start one)")
    v.add_argument("--vllm-python", default=".venv-vllm/bin/python", metavar="EXE",
                   help="the interpreter with vllm, for the server started here "
                   "(default: %(default)s)")
    v.add_argument("--dtype", default="float32",
                   help="the server's --dtype (default: %(default)s, the CPU build's)")
    v.add_argument("--max-model-len", type=int, default=2048, metavar="TOKENS",
                   help="the started server's --max-model-len (default: %(default)s)")
    v.add_argument("--max-num-seqs", type=int, default=8, metavar="N",
                   help="the started server's --max-num-seqs (default: %(default)s)")
    v.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="TOKENS",
                   help="vLLM's token budget per step (default: %(default)s, the CPU "
                   "build's): the simulated engine's compute quota is the fitted time of a "
                   "pass of that many new tokens")
    v.add_argument("--storage-read-gb-per-s", type=float, default=0.0125, metavar=GB_PER_S,
                   help="each node's emulated storage NIC, in GB/s (default: %(default)s, "
                   "vllm_pd_bench.py's 0.1 Gb/s)")
    v.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="GPUs of the engine at --url (started with vLLM's "
                   "--tensor-parallel-size N): recorded, so that `dualpath advise --profile` "
                   "deploys the engine measured; a server started here runs on one "
                   "(default: %(default)s)")
    refuse_flags(p, {"--storage-read-gbps": renamed("--storage-read-gb-per-s", "Gb/s",
                                                    "GB/s: divide by 8")})
    v.add_argument("--staging-blocks", type=int, default=64, metavar="N",
                   help="a decode node's staging buffer in Full Blocks (default: %(default)s, "
                   "vllm_pd_bench.py's)")
    v.add_argument("--loads", choices=("sync", "async"), default="async",
                   help="the prefill instances' loads (the connector's async_loads), which set "
                   "how a prefill node's storage NIC serves its requests' reads in the "
                   "simulation: async, a thread per request, shared; sync, in request order, "
                   "fifo (default: %(default)s, vllm_pd_bench.py's)")
    # What `dualpath run`'s buffer sizing reads, at its defaults.
    p.set_defaults(func=run, agents=8, max_len=1536, temperature=0.0, seed=0)


def _grid(args: argparse.Namespace) -> Any:
    from dualpath.core.step_grid import StepGrid
    from dualpath.runtime.profiler import DEFAULT_GRID, QUICK_GRID

    grid = QUICK_GRID if args.quick else DEFAULT_GRID
    if args.repeats is not None:
        if args.repeats < 1:
            raise SpecError("profile", "repeats", args.repeats, "must be >= 1")
        grid = grid.with_repeats(args.repeats)
    if args.max_context < 64:
        raise SpecError("profile", "max_context", args.max_context, "must be >= 64")
    cap = args.max_context
    return StepGrid(
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


def _written(out: Path, data: dict[str, Any]) -> str:
    """Write the profile, read it back (validated); its description and the fit's errors."""
    from dualpath.plan.step_profile import load_profile, write_profile

    write_profile(out, data)
    fit = data["fit"]
    return (load_profile(out).describe() + f"\nfit median error: prefill "
            f"{fit['prefill_median_error']:.1%}, decode {fit['decode_median_error']:.1%}")


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        return run_vllm(args)
    if args.tensor_parallel_size != 1:
        raise SpecError("profile", "tensor_parallel_size", args.tensor_parallel_size,
                        "the runtime's engines run on one device (--engine vllm --url "
                        "profiles a tensor-parallel server)")
    from tqdm import tqdm

    from dualpath.plan.step_profile import build_profile
    from dualpath.runtime.model.model_source import build_model
    from dualpath.runtime.profiler import measure, num_points

    grid = _grid(args)
    if args.turns is None:
        args.turns = 3 if args.quick else 12
    if args.turns < 0:
        raise SpecError("profile", "turns", args.turns, "must be >= 0")
    cfg = _config(args, "dualpath", store="")
    source = _model_source(args)
    model = build_model(source)
    mc = model.config
    layout = model.kv_layout(cfg.block_size)
    out = args.out or Path(f"profile-{args.model if args.model in ('tiny', 'smollm2') else mc.name}"
                           ".json")
    with tqdm(total=num_points(grid), desc="profile", unit="point", file=sys.stderr,
              disable=args.no_progress) as bar:

        def tick(label: str) -> None:
            bar.set_postfix_str(label, refresh=False)
            bar.update(1)

        m = measure(model, grid, cfg.block_size, on_point=tick)
    turns = _time_turns(args) if args.turns else None
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
             "compute_quota_s": cfg.compute_quota_s, "beta_tokens": cfg.beta_tokens,
             "storage_reads": {"pe": {"discipline": "fifo"}, "de": {"discipline": "fifo"},
                               "why": "a node's one reader thread takes its read jobs in "
                                      "order (runtime/storage_io.py)"}},
        prefill=m.prefill, decode=m.decode, rates=m.rates, turns=turns,
        turns_how=TURNS_HOW,
    )
    print(_written(out, data) + f"; KV {layout.kv_bytes_per_token} B/token; copy "
          f"{m.rates['memory_copy'] / 2**30:.1f} GiB/s in memory, store write "
          f"{m.rates['store_write'] / 2**20:.0f} MiB/s, read {m.rates['store_read'] / 2**20:.0f} "
          "MiB/s")
    print(f"wrote {out}")
    return 0


TURNS_HOW = (
    "one agent's turns, one at a time, through an emulated cluster of the run configuration "
    "(driver -> scheduler process -> prefill and decode nodes -> driver) in the oracle mode "
    "(I/O unpaced); the medians over measured.turns of the time to the first token beyond the "
    "fitted prefill pass (dispatch_s) and from the first token to the next turn's submission "
    "beyond the fitted decode steps (return_s)")


def _time_turns(args: argparse.Namespace) -> list[dict[str, float]]:
    """`--turns` turns timed on an emulated cluster of the run configuration, I/O unpaced."""
    import tempfile

    from tqdm import tqdm

    from dualpath.runtime.profiler import time_turns

    print(f"timing {args.turns} turns through an emulated {args.prefill_nodes}P"
          f"{args.decode_nodes}D cluster (oracle: I/O unpaced; it starts in seconds)",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="dualpath-profile-turns-") as store, \
            tqdm(total=args.turns + 3, desc="turns", unit="turn", file=sys.stderr,
                 disable=args.no_progress) as bar:

        def tick(label: str) -> None:
            bar.set_postfix_str(label, refresh=False)
            bar.update(1)

        return time_turns(_config(args, "oracle", store=store), args.turns, on_turn=tick)


def _vllm_model_folder(args: argparse.Namespace) -> Path:
    if args.model == "smollm2":
        from dualpath.runtime.model.weights import smollm2_folder

        return smollm2_folder()
    folder = Path(args.model)
    if not (folder / "config.json").is_file():
        raise SpecError("profile", "model", args.model,
                        "with --engine vllm: smollm2 or a model folder with config.json")
    return folder


def _copy_rate() -> float:
    """Bytes per second of one 64 MiB copy in memory (the median of 5): what engine-to-engine
    KV moves at between instances on one machine, where the vLLM cluster's NIXL runs over
    shared memory, unpaced."""
    import time

    import numpy as np

    src = np.ones(64 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return float(src.nbytes / sorted(times[1:])[2])


def run_vllm(args: argparse.Namespace) -> int:
    """`dualpath profile --engine vllm`: time a vLLM server, write the profile."""
    import contextlib
    import json
    import tempfile

    from tqdm import tqdm

    from dualpath.core.hf_config import model_from_hf_config
    from dualpath.integrations.vllm.connector.step_plan import storage_read_disciplines
    from dualpath.integrations.vllm.profiler import (
        DEFAULT_VLLM_GRID,
        QUICK_VLLM_GRID,
        ServerArgs,
        instance_cores,
        measure_server,
        start_server,
    )
    from dualpath.integrations.vllm.router.policy import DEFAULT_BETA_TOKENS
    from dualpath.plan.step_profile import build_profile, fit_costs

    grid = QUICK_VLLM_GRID if args.quick else DEFAULT_VLLM_GRID
    if args.repeats is not None:
        if args.repeats < 1:
            raise SpecError("profile", "repeats", args.repeats, "must be >= 1")
        grid = grid.with_repeats(args.repeats)
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "staging_blocks"):
        if getattr(args, name) < 1:
            raise SpecError("profile", name, getattr(args, name), "must be >= 1")
    if not args.storage_read_gb_per_s > 0:
        raise SpecError("profile", "storage_read_gb_per_s", args.storage_read_gb_per_s,
                        "must be > 0")
    if args.tensor_parallel_size < 1 or (args.tensor_parallel_size > 1 and args.url is None):
        raise SpecError("profile", "tensor_parallel_size", args.tensor_parallel_size,
                        "a server started here runs on one device; start yours with vLLM's "
                        "--tensor-parallel-size N and give its --url")
    dtype_bytes = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}.get(
        args.dtype)
    if dtype_bytes is None:
        raise SpecError("profile", "dtype", args.dtype, "must be float32, bfloat16 or float16")
    folder = _vllm_model_folder(args)
    spec = model_from_hf_config(folder, kv_dtype_bytes=dtype_bytes)
    hf = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    server = ServerArgs(model=str(folder), python=args.vllm_python, dtype=args.dtype,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    out = args.out or Path(f"profile-vllm-{folder.name}.json")
    with contextlib.ExitStack() as stack:
        url = args.url
        engine: dict[str, Any] = {"kind": "vllm", "url": url or "", "dtype": args.dtype,
                                  "repeats": grid.repeats,
                                  "tensor_parallel_size": args.tensor_parallel_size}
        if url is None:
            if not Path(args.vllm_python).exists():
                raise SpecError("profile", "vllm_python", args.vllm_python,
                                "no such interpreter (make vllm-setup, or give --url)")
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dualpath-prof-")))
            print(f"starting a vLLM server on {folder} (about a minute)", file=sys.stderr,
                  flush=True)
            url = stack.enter_context(start_server(server, tmp / "vllm.log"))
            engine.update(server.engine(), url="(started by dualpath profile)",
                          cores=",".join(map(str, instance_cores())), prefix_caching=True)
        with tqdm(total=grid.num_steps, desc="profile", unit="point", file=sys.stderr,
                  disable=args.no_progress) as bar:

            def tick(label: str) -> None:
                bar.set_postfix_str(label, refresh=False)
                bar.update(1)

            m = measure_server(url, grid, on_point=tick)
    info = m.info
    engine.update(served_model=info.model, max_model_len=info.max_model_len,
                  kv_block_size=info.block_size, num_gpu_blocks=info.num_gpu_blocks)
    kv = spec.kv_bytes_per_token
    costs, _, _ = fit_costs(m.prefill, m.decode)
    quota = costs.prefill_pass_time_s([(0.0, float(args.max_num_batched_tokens))])
    copy_rate = _copy_rate()
    data = build_profile(
        created=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        machine={"hostname": platform.node(), "platform": platform.platform(),
                 "processor": platform.processor() or platform.machine(),
                 "cpu_count": os.cpu_count() or 0, "python": platform.python_version(),
                 "device": "cpu" if args.url is None else f"unknown (the server at {args.url})"},
        engine=engine,
        model={"name": str(hf.get("_name_or_path") or folder.name),
               "num_layers": spec.num_layers, "hidden_size": int(hf["hidden_size"]),
               "num_attention_heads": int(hf["num_attention_heads"]),
               "num_kv_heads": int(hf.get("num_key_value_heads", hf["num_attention_heads"])),
               "head_dim": int(hf.get("head_dim") or hf["hidden_size"]
                               // hf["num_attention_heads"]),
               "intermediate_size": int(hf["intermediate_size"]),
               "vocab_size": int(hf["vocab_size"]), "kv_dtype_bytes": dtype_bytes,
               "weight_dtype_bytes": dtype_bytes,
               "is_tied_embeddings": bool(hf.get("tie_word_embeddings", False)),
               "kv_bytes_per_token": int(kv)},
        run={"storage_nic_bytes_per_s": args.storage_read_gb_per_s * GB,
             "compute_nic_bytes_per_s": copy_rate,
             "compute_nic": "unpaced: NIXL over shared memory, at the measured memory copy "
                            "rate",
             "engines_per_node": 1,
             "hbm_bytes": int(info.num_gpu_blocks * info.block_size * kv),
             "dram_buffer_bytes": int(args.staging_blocks * info.block_size * kv),
             "block_size": info.block_size,
             "compute_quota_s": quota,
             "compute_quota": f"the fitted pass of max_num_batched_tokens "
                              f"{args.max_num_batched_tokens} new tokens",
             "beta_tokens": float(DEFAULT_BETA_TOKENS),
             "storage_reads": storage_read_disciplines(args.loads == "async")},
        prefill=m.prefill, decode=m.decode, rates={"memory_copy": copy_rate},
    )
    print(_written(out, data) + f"; KV {kv:.0f} B/token, vLLM block "
          f"{info.block_size} tokens, KV cache {info.num_gpu_blocks} blocks")
    print(f"wrote {out}")
    return 0
