"""Options shared by several subcommands: hardware, model and cluster selection, and the
spellings one command refuses with the flag it takes instead.

Units: every bandwidth flag is in GB/s (10^9 bytes per second) and says so in its name
(`--*-gb-per-s`; a 400 Gb/s NIC is 50), every size in GB (`--*-gb`), as vLLM's `--cpu-offload-gb`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dualpath.core.cluster import ClusterSpec
from dualpath.core.errors import DualPathError
from dualpath.core.hardware import HARDWARE_PRESETS, HardwareSpec, hardware_preset
from dualpath.core.hf_config import KV_DTYPE_BYTES, model_from_hf_config
from dualpath.core.model import MODEL_PRESETS, ModelSpec, model_preset
from dualpath.core.read_rate import StorageReadModel, parse_storage_read, storage_read_model
from dualpath.core.units import GB


class CliArgsError(DualPathError, ValueError):
    """A bad or misspelt option, named in one line."""


GB_PER_S = "GB/S"
"""The metavar of every bandwidth flag."""


class _Refused(argparse.Action):
    """An option this command does not take: one line naming the one it does, exit code 2."""

    def __init__(self, option_strings: Sequence[str], dest: str, hint: str = "",
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.hint = hint

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        parser.exit(2, f"{parser.prog}: error: {option_string}: {self.hint}\n")


def out_dir(name: str) -> Path:
    """Where a command writes what it generates unless told: `$DUALPATH_OUT/<name>`, else
    `out/<name>` (git-ignored), never a tracked folder."""
    return Path(os.environ.get("DUALPATH_OUT", "out")) / name


def refuse_flags(parser: argparse.ArgumentParser, hints: Mapping[str, str]) -> None:
    """Give each flag in `hints` (an old spelling, or another command's flag) a one-line
    error with its hint instead of argparse's "unrecognized arguments"."""
    for flag, hint in hints.items():
        parser.add_argument(flag, action=_Refused, hint=hint, dest=f"refused_{flag}")


def renamed(new: str, old_unit: str = "", new_unit: str = "") -> str:
    """The hint of a renamed flag, with the unit change when there is one."""
    if old_unit:
        return f"renamed {new}, in {new_unit} (the old flag was {old_unit})"
    return f"renamed {new}"


GBPS_RENAMES = {
    "--compute-nic-gbps": renamed("--compute-nic-gb-per-s"),
    "--storage-nic-gbps": renamed("--storage-nic-gb-per-s"),
    "--dram-gbps": renamed("--dram-gb-per-s"),
}
"""The planning commands' old bandwidth spellings (the same unit, GB/s, under a new name)."""


def add_cluster_args(
    parser: argparse.ArgumentParser,
    default_model: str = "deepseek-v3.2",
    default_hardware: str = "h800-deepseek",
    default_prefill: int = 2,
    default_decode: int = 4,
    with_nodes: bool = True,
) -> None:
    """--model/--model-config, --hardware with overrides, --tensor-parallel-size, and (unless
    `with_nodes` is false: `advise` sweeps a list instead) --prefill-nodes, --decode-nodes."""
    g = parser.add_argument_group("cluster")
    g.add_argument(
        "--model",
        default=default_model,
        help=f"model preset: {', '.join(MODEL_PRESETS)} (default: %(default)s)",
    )
    g.add_argument(
        "--model-config",
        metavar="PATH",
        help="a HuggingFace config.json (or its folder) for your own model; overrides --model",
    )
    g.add_argument(
        "--kv-dtype-bytes",
        type=int,
        metavar="N",
        help="KV-cache bytes per element for --model-config: 1 (FP8), 2 (FP16/BF16) or 4 "
        "(default: the config's torch_dtype)",
    )
    g.add_argument(
        "--hardware",
        default=default_hardware,
        help=f"node preset: {', '.join(HARDWARE_PRESETS)} (default: %(default)s)",
    )
    g.add_argument("--gpus-per-node", type=int, metavar="G", help="override g")
    g.add_argument("--compute-nic-gb-per-s", type=float, metavar=GB_PER_S,
                   help="override B, one GPU's compute NIC, in GB/s (400 Gb/s = 50)")
    g.add_argument("--storage-nic-gb-per-s", type=float, metavar=GB_PER_S,
                   help="override s*B, one node's storage NICs together, in GB/s")
    g.add_argument("--dram-gb-per-s", type=float, metavar=GB_PER_S,
                   help="override M, one node's DRAM bandwidth, in GB/s")
    g.add_argument(
        "--dram-buffer-gb", type=float, metavar="GB",
        help="override the DRAM each node sets aside as its PE or DE buffer, in GB (the paper: "
             "80 for the DeepSeek models, 320 for Qwen2.5-32B)",
    )
    g.add_argument(
        "--tensor-parallel-size", type=int, default=1, metavar="N",
        help="GPUs one engine (a vLLM instance) spans, as vLLM's --tensor-parallel-size: its "
        "weights and KV heads are sharded over them and each layer all-reduces over NVLink; "
        "a node runs g/N engines (default: %(default)s)",
    )
    refuse_flags(parser, GBPS_RENAMES)
    if not with_nodes:
        refuse_flags(parser, {
            "--prefill-nodes": "advise sweeps P/D configurations: --pd 1P2D,2P2D",
            "--decode-nodes": "advise sweeps P/D configurations: --pd 1P2D,2P2D",
        })
        return
    g.add_argument(
        "--prefill-nodes",
        type=int,
        default=default_prefill,
        metavar="P",
        help="prefill nodes (default: %(default)s)",
    )
    g.add_argument(
        "--decode-nodes",
        type=int,
        default=default_decode,
        metavar="D",
        help="decode nodes (default: %(default)s)",
    )
    refuse_flags(parser, {"--pd": f"{parser.prog.split()[-1]} takes one P/D: "
                          "--prefill-nodes P --decode-nodes D (--pd is advise's list)"})


def hardware_from_args(args: argparse.Namespace) -> HardwareSpec:
    """The chosen preset with any overrides applied (validated)."""
    hw = hardware_preset(args.hardware)
    overrides: dict[str, object] = {}
    if args.gpus_per_node is not None:
        overrides["gpus_per_node"] = args.gpus_per_node
    if args.compute_nic_gb_per_s is not None:
        overrides["compute_nic_bytes_per_s"] = args.compute_nic_gb_per_s * GB
    if args.storage_nic_gb_per_s is not None:
        overrides["storage_nic_bytes_per_s"] = args.storage_nic_gb_per_s * GB
    if args.dram_gb_per_s is not None:
        overrides["dram_bytes_per_s"] = args.dram_gb_per_s * GB
    if getattr(args, "dram_buffer_gb", None) is not None:
        overrides["dram_buffer_bytes"] = round(args.dram_buffer_gb * GB)
    if overrides:
        hw = hw.with_overrides(name=f"{hw.name}+overrides", **overrides)
    return hw


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """--model-config if given, else the --model preset."""
    kv = args.kv_dtype_bytes
    if kv is not None:
        if not args.model_config:
            raise CliArgsError(f"--kv-dtype-bytes={kv}: applies to --model-config only (a "
                               "preset has its own KV format)")
        if kv not in KV_DTYPE_BYTES:
            raise CliArgsError(f"--kv-dtype-bytes={kv}: must be 1 (FP8), 2 (FP16/BF16) or 4 "
                               "(FP32)")
    if args.model_config:
        return model_from_hf_config(args.model_config, kv_dtype_bytes=kv)
    return model_preset(args.model)


def cluster_from_args(args: argparse.Namespace, num_prefill_nodes: int | None = None,
                      num_decode_nodes: int | None = None) -> ClusterSpec:
    """The cluster the options describe (validated); P/D from the arguments unless given."""
    return ClusterSpec(
        hardware=hardware_from_args(args),
        model=model_from_args(args),
        num_prefill_nodes=num_prefill_nodes or args.prefill_nodes,
        num_decode_nodes=num_decode_nodes or args.decode_nodes,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def add_read_side_args(group: argparse._ArgumentGroup) -> None:
    """--read-tie-side and --rr-read-side: the two read-side choices the paper leaves open
    (`SchedulerParams.dual_tie_side`, `SchedulerParams.rr_read_side`); unset, the scheduler's
    defaults."""
    from dualpath.sched.params import DEFAULT_RR_READ_SIDE, DEFAULT_TIE_SIDE, RRReadSide, TieSide

    group.add_argument(
        "--read-tie-side", choices=[k.value for k in TieSide], default=None,
        help="where the dual-path rule reads when the PE's and the DE's read queues are equal "
        "(mostly both empty): pe, de, or balanced (the ties split between the sides in "
        "proportion to their node counts, DE taking D/(P+D), by a deterministic counter); "
        f"the paper does not say (default: {DEFAULT_TIE_SIDE.value})")
    group.add_argument(
        "--rr-read-side", choices=[k.value for k in RRReadSide], default=None,
        help="how the round-robin modes (dual-path) pick a request's read side: queue (the "
        "shorter read queue, as dualpath does) or random (PE or DE with probability 1/2, "
        "ignoring the queues; seeded by --seed); the paper does not say "
        f"(default: {DEFAULT_RR_READ_SIDE.value})")


def read_side_overrides(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The `SchedulerParams` overrides of the `add_read_side_args` options given."""
    given = (("dual_tie_side", args.read_tie_side), ("rr_read_side", args.rr_read_side))
    return tuple((name, value) for name, value in given if value is not None)


STORAGE_READ_HELP = (
    "how fast a storage NIC reads KV: calibrated (the hardware preset's packaged record; "
    "h800-deepseek: 0.538 of the line rate for every block size, fitted on DS 27B Basic), "
    "nominal (the line rate), flat:F (F of it), queued[:C] (3FS as measured in "
    "deepseek-ai/3FS#410: each read 0.514 ms + its bytes at 1.26 GB/s, C reads in flight "
    "(default 32, that benchmark's), capped at 0.9 of the line rate, so larger Full Blocks "
    "read faster: 0.55 of the line rate for DS 27B's 1.4 MB, 0.67 for DeepSeek-V3.2's 3.1 MB, "
    "0.78 for Qwen2.5-32B's 16.8 MB; the paper's Qwen Basic implies about 0.75, its "
    "DeepSeek-V3.2 Basic about 0.48: docs/reproduction/README.md, storage section) "
    "(default: %(default)s)")


def add_storage_read_arg(group: argparse._ActionsContainer) -> None:
    """--storage-read: the storage NICs' read model (`parse_storage_read`)."""
    group.add_argument("--storage-read", default="calibrated",
                       metavar="calibrated|nominal|flat:F|queued[:C]", help=STORAGE_READ_HELP)


def storage_read_from_args(args: argparse.Namespace) -> StorageReadModel | None:
    """The --storage-read model; None: the hardware's packaged record."""
    return parse_storage_read(args.storage_read)


def storage_read_line(cluster: ClusterSpec, chosen: StorageReadModel | None,
                      block_tokens: int) -> str:
    """One line saying how fast the cluster's storage NICs read its model's Full Blocks, and a
    second with `plan.storage_note.block_size_note` when the calibrated flat rate meets
    blocks far from the size it was fitted on."""
    model = chosen or storage_read_model(cluster.hardware.name)
    nominal = cluster.hardware.storage_nic_bytes_per_s
    block = float(cluster.model.kv_bytes_per_token * block_tokens)
    rate = model.read_bytes_per_s(nominal, block)
    if chosen is None and model.is_nominal:
        return (f"storage reads at the line rate, {nominal / GB:g} GB/s per storage NIC: "
                f"{cluster.hardware.name} has no calibrated storage record, so this is an upper "
                "bound (the paper's 3FS reads about half of it; --storage-read queued or "
                "flat:F models yours)")
    which = "calibrated" if chosen is None else "--storage-read"
    line = (f"storage reads ({which}, {model.describe()}): {rate / GB:.1f} GB/s per storage NIC "
            f"for {block / 1e6:.2f} MB Full Blocks, {rate / nominal:.3f} of the "
            f"{nominal / GB:g} GB/s line rate")
    if chosen is not None:
        return line
    from dualpath.plan.storage_note import block_size_note  # the experiments' data: lazily

    note = block_size_note(block, nominal, cluster.hardware.name)
    return f"{line}\n{note}" if note else line
