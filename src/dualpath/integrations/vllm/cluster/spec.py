"""The spec of a P/D cluster of vLLM servers (`VllmClusterSpec`) and the option values and
help texts every command that starts one shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dualpath.core.errors import SpecError
from dualpath.integrations.vllm.compute_quota import ComputeQuota
from dualpath.transport.traffic_class import KVTrafficClass


@dataclass(frozen=True)
class VllmClusterSpec:
    model: str
    """An HF-style model folder (vLLM 0.32 on CPU loads no GGUF: the converted SmolLM2)."""
    store: Path
    python: str
    """The interpreter of the venv that has vllm."""
    num_prefill: int = 1
    num_decode: int = 1
    log_dir: Path | None = None
    """One `<name>.log` per instance (default: the store's parent folder)."""
    max_model_len: int = 2048
    max_num_seqs: int = 8
    staging_blocks: int = 32
    kv_cache_gib: int = 1
    durable: bool = False
    event_logs: bool = True
    startup_timeout_s: float = 600.0
    stop_grace_s: float = 10.0
    """From SIGTERM to SIGKILL when a server's process group is taken down."""
    kv_events: bool = False
    """Each instance publishes vLLM's KV events over ZMQ (`--kv-events-config`, on a port of
    its own: `Instance.kv_events`), the connector's `medium="STORAGE"` ones included."""
    chat_template: Path | None = None
    """A Jinja file; default: ChatML when the model folder has no template."""
    storage_read_gbps: float | None = None
    """Each instance's emulated storage NIC for reads (None: unpaced)."""
    async_loads: bool = False
    """The prefill instances' background loads (`async_loads` of the connector)."""
    blocks_per_file: int | None = None
    """vLLM blocks per store file (the connector's `blocks_per_file`; None: its default,
    files of at least 128 tokens)."""
    hosts: str = "loopback"
    """"loopback": every instance on 127.0.0.1; "netns": each in a network namespace of its
    own on a bridge, an emulated host reached over veth and TCP (`netns`; needs root)."""
    dtype: str = "float32"
    """vLLM's `--dtype` (CPU: float32; a GPU deployment: bfloat16 or auto)."""
    cuda_graphs: bool = False
    """Run with CUDA graphs (the connector makes vLLM use PIECEWISE ones); False passes
    `--enforce-eager` (on CPU, torch.compile's warm-up alone takes minutes)."""
    tensor_parallel_size: int = 1
    """Ranks per instance (`--tensor-parallel-size`); a decode instance's ranks serve their
    side channels on consecutive ports."""
    data_parallel_size: int = 1
    """Data-parallel ranks per instance, each a server of its own on its own port (vLLM's
    external load balancing, `--data-parallel-rank`, for a mixture-of-experts model; a dense
    model's ranks are independent servers): the router takes each rank as an engine, the
    ranks of one instance as one node (`Instance.node`)."""
    gpus: tuple[str, ...] = ()
    """GPU ids to share out: instance `i` gets `CUDA_VISIBLE_DEVICES` of the ids
    `[i * tensor_parallel_size, (i + 1) * tensor_parallel_size)` (empty: not set)."""
    bind_cpus: bool = True
    """Give each instance cores of its own (`cpu_sets`), as if each were a host. vLLM's CPU
    worker binds its threads to all the cores of a NUMA node by default, so two instances on
    one machine pin their main threads to the same core, and one of them starves (a decode
    instance and its staging service, for tens of seconds at a time). An explicit
    `VLLM_CPU_OMP_THREADS_BIND` in the environment is left alone."""
    extra_args: tuple[str, ...] = ()
    stack: str = "dualpath"
    """The instances' connectors: "dualpath" (`DualPathConnector`) or "vllm-stock" (vLLM's own
    NIXL P/D and, with `stock_fs_tier`, its filesystem KV tier in `store`: `stock`)."""
    stock_fs_tier: bool = True
    """"vllm-stock" with vLLM's filesystem tier (which vLLM 0.32 refuses on CPU:
    `stock.FS_ON_CPU_ERROR`); False: NIXL P/D alone, every prompt recomputed."""
    connector_by_name: bool = False
    """Name the connector only (`"kv_connector": "DualPathConnector"`), as vLLM finds it when
    the dualpath wheel's plugin registered it (`plugin`); False also gives its module path,
    which needs no plugin."""
    address: str | None = None
    """This host's address as the other hosts reach it (a name or an IP of the cluster
    network), for instances that serve other hosts (`dualpath vllm up --role`): they listen on
    every interface, on fixed ports (`first_port` up, side channels `first_side_port` up), and
    the side channels on `address`. None: the instances serve this machine (`hosts`)."""
    first_port: int = 8000
    first_side_port: int = 9000
    served_model_name: str | None = None
    """The name the servers answer to (`--served-model-name`); None: vLLM's default, the
    `model` argument (a folder's path)."""

    kv_traffic_class: KVTrafficClass = field(default_factory=KVTrafficClass)
    """The fabric class of the connectors' KV transfers (IB service level, RoCE traffic
    class), set on their NIXL agents' UCX contexts only (`transport.traffic_class`)."""
    compute_quota: ComputeQuota | None = None
    """The prefill instances' compute quota per step (`QuotaScheduler`; None: vLLM's
    scheduler)."""

    def __post_init__(self) -> None:
        if min(self.num_prefill, self.num_decode) < 0 or self.num_prefill + self.num_decode < 1:
            raise SpecError("vllm cluster", "num_prefill/num_decode",
                            (self.num_prefill, self.num_decode), "need at least one instance")
        if self.address is not None and self.hosts != "loopback":
            raise SpecError("vllm cluster", "address", self.address,
                            "serves real hosts: hosts must be loopback (no emulated hosts)")
        if self.stack not in STACKS:
            raise SpecError("vllm cluster", "stack", self.stack,
                            f"must be one of {', '.join(STACKS)}")
        if self.tensor_parallel_size < 1:
            raise SpecError("vllm cluster", "tensor_parallel_size", self.tensor_parallel_size,
                            "must be >= 1")
        if self.data_parallel_size < 1:
            raise SpecError("vllm cluster", "data_parallel_size", self.data_parallel_size,
                            "must be >= 1")
        need = (self.num_prefill + self.num_decode) * self.tensor_parallel_size \
            * self.data_parallel_size
        if self.gpus and len(self.gpus) < need:
            raise SpecError("vllm cluster", "gpus", ",".join(self.gpus),
                            f"{self.num_prefill + self.num_decode} instances x "
                            f"{self.data_parallel_size * self.tensor_parallel_size} ranks "
                            f"need {need} GPUs")

    def instance_gpus(self, index: int) -> dict[str, str]:
        """The environment that gives server `index` (an instance, or one data-parallel rank
        of one) its GPUs (nothing without `gpus`)."""
        if not self.gpus:
            return {}
        tp = self.tensor_parallel_size
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.gpus[index * tp:(index + 1) * tp])}


STACKS = ("dualpath", "vllm-stock")

HOST_MODES = ("loopback", "netns")
HOSTS_HELP = ("loopback: every server on 127.0.0.1; netns: each server on an emulated host of "
              "its own, a network namespace on a bridge, reached over veth and TCP (UCX too; "
              "needs root) (default: %(default)s)")
"""The `--hosts` option's help, the same wherever a command starts a cluster."""
LOAD_MODES = ("sync", "async")
LOADS_HELP = ("sync: each prefill step waits for its own requests' reads (the DE side pulled "
              "layer by layer); async: the prefill instances load in the background (connector "
              "async_loads), a step does not wait for other requests' reads (default: "
              "%(default)s)")
"""The `--loads` option's help."""
