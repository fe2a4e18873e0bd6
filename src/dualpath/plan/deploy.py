"""The commands that deploy a recommended P/D on real nodes: one vLLM server per prefill and
decode instance with `DualPathConnector`'s `--kv-transfer-config`, and the `dualpath route` in
front of them (what `dualpath advise` prints).

The server command lines come from the vLLM cluster launcher's own builder
(`integrations.vllm.cluster.launch.server_command` and `kv_transfer_config`), so a pasted
command is the one `VllmCluster` runs, with the host's name in place of the loopback address.
Hosts are named `prefill-N` and `decode-N` (one per node of the recommendation); every node and
the router mount the same block store at `store`.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from pathlib import Path

from dualpath.core.errors import SpecError
from dualpath.integrations.vllm.cluster.command import kv_transfer_config, server_command
from dualpath.integrations.vllm.cluster.spec import VllmClusterSpec
from dualpath.integrations.vllm.router.policy import ROUTE_MODES

SERVER_PORT = 8000
"""The first instance's HTTP port on a node; the next instances count up."""
SIDE_PORT = 9000
"""The first decode instance's side-channel port on a node (one per rank, counting up)."""
ROUTER_PORT = 8080


@dataclass(frozen=True)
class Launch:
    """One command to run on one host."""

    host: str
    role: str
    command: str
    url: str = ""
    side_channel: str = ""


def deployment(
    num_prefill_nodes: int, num_decode_nodes: int, gpus_per_node: int, *, model: str,
    store: str, mode: str = "dualpath", python: str = "python3",
    tensor_parallel_size: int = 1, storage_gbps: float | None = None,
    max_model_len: int = 65536, max_num_seqs: int = 256, dtype: str = "auto",
    cuda_graphs: bool = True, staging_blocks: int | None = None,
) -> list[Launch]:
    """Every vLLM server of the P/D (an instance per `tensor_parallel_size` GPUs of each node),
    then the router (on `router`, a host of its own or any of them)."""
    if tensor_parallel_size < 1 or gpus_per_node % tensor_parallel_size:
        raise SpecError("deploy", "tensor_parallel_size", tensor_parallel_size,
                        f"must divide the {gpus_per_node} GPUs of a node")
    spec = VllmClusterSpec(model=model, store=Path(store), python=python,
                           num_prefill=num_prefill_nodes, num_decode=num_decode_nodes,
                           max_model_len=max_model_len, max_num_seqs=max_num_seqs, dtype=dtype,
                           cuda_graphs=cuda_graphs, tensor_parallel_size=tensor_parallel_size,
                           event_logs=False, bind_cpus=False)
    if staging_blocks is not None:
        spec = replace(spec, staging_blocks=staging_blocks)
    per_node = gpus_per_node // tensor_parallel_size
    out: list[Launch] = []
    for role, count in (("prefill", num_prefill_nodes), ("decode", num_decode_nodes)):
        for n in range(count):
            host = f"{role}-{n}"
            for i in range(per_node):
                port = SERVER_PORT + i
                side = (f"{host}:{SIDE_PORT + i * tensor_parallel_size}"
                        if role == "decode" else None)
                cmd = server_command(spec, port, kv_transfer_config(spec, role, side, None),
                                     None, host="0.0.0.0")
                gpus = ",".join(str(g) for g in range(i * tensor_parallel_size,
                                                      (i + 1) * tensor_parallel_size))
                out.append(Launch(host, role,
                                  f"CUDA_VISIBLE_DEVICES={gpus} {shlex.join(cmd)}",
                                  f"http://{host}:{port}", side or ""))
    route = ["dualpath", "route"]
    for inst in out:
        if inst.role == "prefill":
            route += ["--prefill", inst.url]
    for inst in out:
        if inst.role == "decode":
            route += ["--decode", inst.url, "--side", inst.side_channel]
    route += ["--store", store, "--mode", mode if mode in ROUTE_MODES else "dualpath"]
    if storage_gbps:
        route += ["--storage-gbps", f"{storage_gbps:g}"]
    route += ["--host", "0.0.0.0", "--port", str(ROUTER_PORT)]
    out.append(Launch("router", "router", shlex.join(route), f"http://router:{ROUTER_PORT}"))
    return out


def render(launches: list[Launch]) -> str:
    """The commands, one per line, each after a `# host (role)` comment."""
    lines = []
    for inst in launches:
        lines.append(f"# on {inst.host} ({inst.role}{', ' + inst.url if inst.url else ''})")
        lines.append(inst.command)
    return "\n".join(lines)
