"""The commands that deploy a planned cluster on real nodes: one vLLM server per prefill and
decode engine with `DualPathConnector`'s `--kv-transfer-config`, and the `dualpath route` in
front of them (what `dualpath advise` prints), with the reason for every setting that is not
vLLM's or the connector's default.

The commands describe the simulated cluster (`ClusterSpec`): an instance per engine, as many per
node as the plan has engines per node, each on `tensor_parallel_size` GPUs; the decode
instances' staging buffers are the plan's DE buffer. The server command lines come from the
vLLM cluster launcher's own builder (`integrations.vllm.cluster.command`), so a pasted command
is the one `VllmCluster` runs, with the host's name in place of the loopback address. Hosts are
named `prefill-N` and `decode-N` (one per node); every node and the router mount the same block
store at `store`.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dualpath.core.cluster import ClusterSpec
from dualpath.core.units import GB
from dualpath.integrations.vllm.cluster.command import kv_transfer_config, server_command
from dualpath.integrations.vllm.cluster.spec import VllmClusterSpec
from dualpath.integrations.vllm.router.policy import ROUTE_MODES

SERVER_PORT = 8000
"""The first instance's HTTP port on a node; the next instances count up."""
SIDE_PORT = 9000
"""The first decode instance's side-channel port on a node (one per rank, counting up)."""
ROUTER_PORT = 8080
VLLM_MAX_NUM_SEQS = 256
"""vLLM's own `--max-num-seqs` default, printed where the plan sets no sequence cap."""


@dataclass(frozen=True)
class Launch:
    """One command to run on one host."""

    host: str
    role: str
    command: str
    url: str = ""
    side_channel: str = ""


@dataclass(frozen=True)
class Staging:
    """A decode rank's staging buffer, sized from the plan."""

    gb_per_rank: float
    why: str


def staging_of(cluster: ClusterSpec, max_model_len: int) -> Staging:
    """The plan's DE buffer (`HardwareSpec.dram_buffer_bytes` of a node) split over the node's
    GPUs (each rank stages its own shard), raised to one longest prompt if that is larger."""
    hw, model, tp = cluster.hardware, cluster.model, cluster.tensor_parallel_size
    prompt_bytes = max_model_len * model.kv_bytes_per_token
    prompt_rank = prompt_bytes * model.kv_replicas(tp) / tp
    buffer_rank = hw.dram_buffer_bytes / hw.gpus_per_node
    gb = math.ceil(max(buffer_rank, prompt_rank) / GB * 10) / 10
    fits = int(gb * GB // prompt_rank)
    where = (f"the plan's {hw.dram_buffer_bytes / GB:g} GB DE buffer per node over its "
             f"{hw.gpus_per_node} GPUs" if buffer_rank >= prompt_rank
             else f"one longest prompt (the plan's {buffer_rank / GB:.2g} GB a rank holds none)")
    return Staging(gb, f"staging_gb {gb:g} (per rank): {where}; room for {fits} prompt(s) of "
                       f"{max_model_len:,} tokens ({prompt_bytes / GB:.3g} GB of KV, "
                       f"{prompt_rank / GB:.3g} GB a rank) in flight to each decode instance")


@dataclass(frozen=True)
class Deployment:
    """The commands, and why each non-default setting is there."""

    launches: list[Launch]
    reasons: list[str] = field(default_factory=list)

    def servers(self, role: str) -> list[Launch]:
        return [x for x in self.launches if x.role == role]


def deployment(
    cluster: ClusterSpec, *, model: str, store: str, mode: str = "dualpath",
    python: str = "python3", max_model_len: int = 65536, max_num_seqs: int = 0,
    dtype: str = "auto", cuda_graphs: bool = True, staging_blocks: int | None = None,
    context_why: str = "", measured_tp: int = 0,
) -> Deployment:
    """Every vLLM server of `cluster` (an instance per engine), then the router (on `router`,
    a host of its own or any of them). `max_num_seqs` 0: the plan's sequence cap, else vLLM's
    default; `staging_blocks`, `measured_tp`: a profiled engine's buffer and GPUs (its
    simulated cluster counts the engine as one device; None and 0: the plan's)."""
    tp = measured_tp or cluster.tensor_parallel_size
    seqs = max_num_seqs or VLLM_MAX_NUM_SEQS
    spec = VllmClusterSpec(model=model, store=Path(store), python=python,
                           num_prefill=cluster.num_prefill_nodes,
                           num_decode=cluster.num_decode_nodes, max_model_len=max_model_len,
                           max_num_seqs=seqs, dtype=dtype, cuda_graphs=cuda_graphs,
                           tensor_parallel_size=tp, event_logs=False, bind_cpus=False,
                           durable=True)
    staging = None
    if staging_blocks is not None:
        spec = replace(spec, staging_blocks=staging_blocks)
    else:
        staging = staging_of(cluster, max_model_len)
    out: list[Launch] = []
    for role, count in (("prefill", cluster.num_prefill_nodes),
                        ("decode", cluster.num_decode_nodes)):
        for n in range(count):
            host = f"{role}-{n}"
            for i in range(cluster.engines_per_node):
                port = SERVER_PORT + i
                side = f"{host}:{SIDE_PORT + i * tp}" if role == "decode" else None
                config = kv_transfer_config(spec, role, side, None)
                if role == "decode" and staging is not None:
                    _stage_in_gb(config, staging.gb_per_rank)
                cmd = server_command(spec, port, config, None, host="0.0.0.0")
                gpus = ",".join(str(g) for g in range(i * tp, (i + 1) * tp))
                out.append(Launch(host, role, f"CUDA_VISIBLE_DEVICES={gpus} {shlex.join(cmd)}",
                                  f"http://{host}:{port}", side or ""))
    snic_gb_per_s = cluster.hardware.storage_nic_bytes_per_s / GB
    route = ["dualpath", "route"]
    for inst in out:
        if inst.role == "prefill":
            route += ["--prefill", inst.url]
    for inst in out:
        if inst.role == "decode":
            route += ["--decode", inst.url, "--side", inst.side_channel]
    route += ["--store", store, "--mode", mode if mode in ROUTE_MODES else "dualpath",
              "--storage-nic-gb-per-s", f"{snic_gb_per_s:g}",
              "--host", "0.0.0.0", "--port", str(ROUTER_PORT)]
    out.append(Launch("router", "router", shlex.join(route), f"http://router:{ROUTER_PORT}"))
    engines = (f"the profiled engine's {tp} GPU(s), {cluster.engines_per_node} per node as "
               "simulated" if measured_tp else
               f"the plan's engines, {cluster.engines_per_node} per node of "
               f"{cluster.hardware.gpus_per_node} GPUs, {tp} GPU(s) each")
    reasons = [
        f"--tensor-parallel-size {tp}, CUDA_VISIBLE_DEVICES: {engines}"
        + ("" if tp > 1 else " (1 is vLLM's default, so no flag)"),
        "--no-enable-prefix-caching: every turn's stored prefix is loaded from the block "
        "store, as the plan simulates (no HBM prefix cache); with vLLM's prefix cache on, "
        "some hits would come from HBM where the router cannot see them, so its read plans "
        "would not be what the servers read (docs/vllm/deploy.md)",
        '"durable": true (the connector\'s default, stated): every block file is fsynced '
        "before it counts as stored; false risks a crash's last blocks (recomputed, never "
        "wrong) for faster writes",
        f"--max-model-len {max_model_len}: {context_why or 'the longest context planned'}",
        f"--max-num-seqs {seqs}: " + ("the plan's sequence cap per decode engine"
                                      if max_num_seqs else
                                      "vLLM's default; the plan caps a decode engine's "
                                      "sequences by its HBM only"),
        f"--storage-nic-gb-per-s {snic_gb_per_s:g} (router): a node's storage NIC, which "
        "sets the short-read-queue threshold alpha (3 s of reads)",
        "DUALPATH_SIDE_CHANNEL_SECRET in every server's environment, the same on every host "
        "(e.g. made once with `openssl rand -hex 32`): a decode node's staging service serves "
        "only peers that hold it, and refuses to start on a non-loopback address without one",
    ]
    if staging is not None:
        reasons.append(staging.why)
    else:
        reasons.append(f"staging_blocks {staging_blocks}: the profiled engine's staging buffer")
    return Deployment(out, reasons)


def _stage_in_gb(config: dict[str, Any], gb: float) -> None:
    extra = config["kv_connector_extra_config"]
    extra.pop("staging_blocks", None)
    extra["staging_gb"] = gb


def render(plan: Deployment) -> str:
    """The commands, one per line, each after a `# host (role)` comment, then the reasons."""
    lines = []
    for inst in plan.launches:
        lines.append(f"# on {inst.host} ({inst.role}{', ' + inst.url if inst.url else ''})")
        lines.append(inst.command)
    if plan.reasons:
        lines.append("# why these settings:")
        lines += [f"#   {why}" for why in plan.reasons]
    return "\n".join(lines)
