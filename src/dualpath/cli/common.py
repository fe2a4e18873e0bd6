"""Options shared by several subcommands: hardware, model and cluster selection."""

from __future__ import annotations

import argparse

from dualpath.core.cluster import ClusterSpec
from dualpath.core.hardware import HARDWARE_PRESETS, HardwareSpec, hardware_preset
from dualpath.core.model import MODEL_PRESETS, ModelSpec, model_from_hf_config, model_preset
from dualpath.core.read_rate import StorageReadModel, parse_storage_read, storage_read_model
from dualpath.core.units import GB


def add_cluster_args(
    parser: argparse.ArgumentParser,
    default_model: str = "deepseek-v3.2",
    default_hardware: str = "h800-deepseek",
    default_prefill: int = 2,
    default_decode: int = 4,
) -> None:
    """--model/--model-config, --hardware with overrides, --prefill-nodes, --decode-nodes."""
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
        help="KV-cache bytes per element for --model-config (default: the config's torch_dtype)",
    )
    g.add_argument(
        "--hardware",
        default=default_hardware,
        help=f"node preset: {', '.join(HARDWARE_PRESETS)} (default: %(default)s)",
    )
    g.add_argument("--gpus-per-node", type=int, metavar="G", help="override g")
    g.add_argument(
        "--compute-nic-gbps", type=float, metavar="GB/S", help="override B, per GPU, in GB/s"
    )
    g.add_argument(
        "--storage-nic-gbps", type=float, metavar="GB/S", help="override s*B, per node, in GB/s"
    )
    g.add_argument("--dram-gbps", type=float, metavar="GB/S", help="override M, per node, in GB/s")
    g.add_argument(
        "--dram-buffer-gb", type=float, metavar="GB",
        help="override the DRAM each node sets aside as its PE or DE buffer, in GB (the paper: "
             "80 for the DeepSeek models, 320 for Qwen2.5-32B)",
    )
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


def hardware_from_args(args: argparse.Namespace) -> HardwareSpec:
    """The chosen preset with any overrides applied (validated)."""
    hw = hardware_preset(args.hardware)
    overrides: dict[str, object] = {}
    if args.gpus_per_node is not None:
        overrides["gpus_per_node"] = args.gpus_per_node
    if args.compute_nic_gbps is not None:
        overrides["compute_nic_bytes_per_s"] = args.compute_nic_gbps * GB
    if args.storage_nic_gbps is not None:
        overrides["storage_nic_bytes_per_s"] = args.storage_nic_gbps * GB
    if args.dram_gbps is not None:
        overrides["dram_bytes_per_s"] = args.dram_gbps * GB
    if getattr(args, "dram_buffer_gb", None) is not None:
        overrides["dram_buffer_bytes"] = round(args.dram_buffer_gb * GB)
    if overrides:
        hw = hw.with_overrides(name=f"{hw.name}+overrides", **overrides)
    return hw


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """--model-config if given, else the --model preset."""
    if args.model_config:
        return model_from_hf_config(args.model_config, kv_dtype_bytes=args.kv_dtype_bytes)
    return model_preset(args.model)


def cluster_from_args(args: argparse.Namespace) -> ClusterSpec:
    """The cluster the options describe (validated)."""
    return ClusterSpec(
        hardware=hardware_from_args(args),
        model=model_from_args(args),
        num_prefill_nodes=args.prefill_nodes,
        num_decode_nodes=args.decode_nodes,
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
    "DeepSeek-V3.2 Basic about 0.48: docs/reproduction.md, storage section) "
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
    which = "calibrated" if chosen is None else "--storage-read"
    line = (f"storage reads ({which}, {model.describe()}): {rate / GB:.1f} GB/s per storage NIC "
            f"for {block / 1e6:.2f} MB Full Blocks, {rate / nominal:.3f} of the "
            f"{nominal / GB:g} GB/s line rate")
    if chosen is not None:
        return line
    from dualpath.plan.storage_note import block_size_note  # the experiments' data: lazily

    note = block_size_note(block, nominal, cluster.hardware.name)
    return f"{line}\n{note}" if note else line
