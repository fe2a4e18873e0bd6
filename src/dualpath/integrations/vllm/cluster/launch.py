"""Start and stop a P/D cluster of vLLM OpenAI servers with `DualPathConnector` on one machine.

`VllmCluster(spec).start()` launches `num_prefill` prefill instances (`kv_role` kv_producer)
and `num_decode` decode instances (kv_consumer, each with a side channel for its staging
buffer), every one a `python -m vllm.entrypoints.openai.api_server` process of the vLLM venv
on 127.0.0.1, all on one shared store folder; it waits for each `/health` and `stop()` ends
them. Nothing here imports vllm: the servers run in `spec.python`, which must have it (`make
vllm-setup`).

Each server runs under a `reaper` (its own session and process group, tagged): however the
server ends, or the launcher (even SIGKILLed), no process or `/dev/shm` segment of it is
left. `supervise()` watches the servers: a dead one is reported and restarted on the same
ports (the router's polls bring it back into service).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from dualpath.core.errors import SpecError
from dualpath.integrations.vllm.cluster import netns, reaper, stock

CONNECTOR_MODULE = "dualpath.integrations.vllm.connector.dualpath_connector"
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""ChatML, SmolLM2-Instruct's chat format, for model folders without a template of their own
(the GGUF-converted SmolLM2 folder has no `tokenizer_config.json`)."""


def has_chat_template(model: str) -> bool:
    """Whether an HF-style folder carries a chat template vLLM will find."""
    folder = Path(model)
    if (folder / "chat_template.jinja").exists():
        return True
    config = folder / "tokenizer_config.json"
    with contextlib.suppress(OSError, ValueError):
        return "chat_template" in json.loads(config.read_text(encoding="utf-8"))
    return False


class LaunchError(RuntimeError):
    """An instance that exited or did not become healthy in time (its log tail attached)."""


def _die_with_parent() -> None:
    """In the reaper before exec: SIGTERM when the process that started it dies (Linux
    prctl PR_SET_PDEATHSIG), so a killed driver never leaves servers running (the reaper
    takes its server's group down)."""
    reaper.die_with_parent(signal.SIGTERM)


def free_port(taken: set[int] | None = None) -> int:
    """A port free on 127.0.0.1 now and not in `taken` (ports handed out for servers that
    have not bound them yet: the kernel would hand one of them out again); added to it."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if taken is None or port not in taken:
            if taken is not None:
                taken.add(port)
            return port
    raise OSError("no free port outside those already handed out")


def free_ports(n: int, taken: set[int] | None = None) -> int:
    """The first of `n` consecutive ports free on 127.0.0.1 now and not in `taken`
    (added to it)."""
    for _ in range(100):
        base = free_port()
        if base + n > 65536:
            continue
        if taken is not None and taken.intersection(range(base, base + n)):
            continue
        with contextlib.ExitStack() as held:
            try:
                for port in range(base + 1, base + n):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
            if taken is not None:
                taken.update(range(base, base + n))
            return base
    raise OSError(f"no {n} consecutive free ports")


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
    gpus: tuple[str, ...] = ()
    """GPU ids to share out: instance `i` gets `CUDA_VISIBLE_DEVICES` of the ids
    `[i * tensor_parallel_size, (i + 1) * tensor_parallel_size)` (empty: not set)."""
    bind_cpus: bool = True
    """Give each instance cores of its own (`cpu_sets`), as if each were a host. vLLM's CPU
    worker binds its threads to all the cores of a NUMA node by default, so two instances on
    one machine pin their main threads to the same core, and one of them starves (a decode
    instance and its staging service got no CPU for 46 s at a time, on 2 cores). An
    explicit `VLLM_CPU_OMP_THREADS_BIND` in the environment is left alone."""
    extra_args: tuple[str, ...] = ()
    stack: str = "dualpath"
    """The instances' connectors: "dualpath" (`DualPathConnector`) or "vllm-stock" (vLLM's own
    NIXL P/D and, with `stock_fs_tier`, its filesystem KV tier in `store`: `stock`)."""
    stock_fs_tier: bool = True
    """"vllm-stock" with vLLM's filesystem tier (which vLLM 0.32 refuses on CPU:
    `stock.FS_ON_CPU_ERROR`); False: NIXL P/D alone, every prompt recomputed."""

    def __post_init__(self) -> None:
        if self.stack not in STACKS:
            raise SpecError("vllm cluster", "stack", self.stack,
                            f"must be one of {', '.join(STACKS)}")
        if self.tensor_parallel_size < 1:
            raise SpecError("vllm cluster", "tensor_parallel_size", self.tensor_parallel_size,
                            "must be >= 1")
        need = (self.num_prefill + self.num_decode) * self.tensor_parallel_size
        if self.gpus and len(self.gpus) < need:
            raise SpecError("vllm cluster", "gpus", ",".join(self.gpus),
                            f"{self.num_prefill + self.num_decode} instances x "
                            f"{self.tensor_parallel_size} ranks need {need} GPUs")

    def instance_gpus(self, index: int) -> dict[str, str]:
        """The environment that gives instance `index` its GPUs (nothing without `gpus`)."""
        if not self.gpus:
            return {}
        tp = self.tensor_parallel_size
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.gpus[index * tp:(index + 1) * tp])}


STACKS = ("dualpath", "vllm-stock")


def _topology(cpu: int) -> tuple[int, int]:
    """(socket, physical core) of a logical CPU, from sysfs ((0, cpu) where it is missing)."""
    base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return (int((base / "physical_package_id").read_text()),
                int((base / "core_id").read_text()))
    except (OSError, ValueError):
        return (0, cpu)


def cpu_sets(num_instances: int, cpus: Sequence[int],
             topology: Callable[[int], tuple[int, int]] = _topology
             ) -> list[list[int]] | None:
    """`cpus` split into `num_instances` disjoint runs, in (socket, physical core, id) order
    so that hyperthread siblings stay together and an instance stays on one socket where it
    can; the earlier instances take the remainder. None when there are fewer cores than
    instances."""
    cpus = sorted(cpus, key=lambda c: (*topology(c), c))
    if num_instances < 1 or len(cpus) < num_instances:
        return None
    size, extra = divmod(len(cpus), num_instances)
    sets, lo = [], 0
    for i in range(num_instances):
        hi = lo + size + (1 if i < extra else 0)
        sets.append(sorted(cpus[lo:hi]))
        lo = hi
    return sets


def cpu_binding(spec: VllmClusterSpec, num_instances: int) -> list[dict[str, str]]:
    """The environment that binds each instance's vLLM worker (`VllmClusterSpec.bind_cpus`):
    `VLLM_CPU_OMP_THREADS_BIND` to a core set of its own; with fewer cores than instances,
    no binding and one OpenMP thread each (they share the cores, none is pinned). An instance
    of several ranks (tensor or pipeline parallel in `extra_args`) needs one list per rank:
    then the binding is left to the environment."""
    parallel = spec.tensor_parallel_size > 1 or any(a.startswith(
        ("--tensor-parallel-size", "--pipeline-parallel-size", "-tp", "-pp"))
        for a in spec.extra_args)
    if not spec.bind_cpus or parallel or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return [{} for _ in range(num_instances)]
    sets = cpu_sets(num_instances, list(os.sched_getaffinity(0)))
    if sets is None:
        return [{"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
                for _ in range(num_instances)]
    return [{"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))} for cores in sets]


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


@dataclass
class Instance:
    name: str
    role: str
    """"prefill" or "decode"."""
    port: int
    side_channel: str | None
    process: subprocess.Popen[bytes]
    """The server's reaper (`reaper`): its pid is the server's process group."""
    log_path: Path
    event_log: Path | None
    _log: IO[bytes] | None = field(default=None, repr=False)
    host: str = "127.0.0.1"
    """The address it serves on (its emulated host's, with `hosts="netns"`)."""
    netns: str | None = None
    cpus: str = ""
    """Its `VLLM_CPU_OMP_THREADS_BIND` ("" when the environment decides)."""
    tag: str = ""
    """Names its shared memory (`reaper.TAG_ENV`): `dp<launcher pid>.<name>`."""
    command: list[str] = field(default_factory=list, repr=False)
    env: dict[str, str] = field(default_factory=dict, repr=False)
    restarts: int = 0
    started_at: float = 0.0
    """`time.monotonic()` of its last (re)start."""
    is_gone: bool = False
    """Died and not restarted (`supervise(restart=False)`)."""
    kv_events: str | None = None
    """Where its KV events are published (`tcp://host:port`; `VllmClusterSpec.kv_events`)."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def server_pid(self) -> int | None:
        """The vLLM server's own pid (the reaper's child; None while there is none)."""
        pid = self.process.pid
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])
        return None

    def log_tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def events(self) -> list[dict[str, Any]]:
        """The connector's event log (worker side)."""
        if self.event_log is None or not self.event_log.exists():
            return []
        return [json.loads(x) for x in self.event_log.read_text().splitlines() if x.strip()]


def kv_transfer_config(spec: VllmClusterSpec, role: str, side_channel: str | None,
                       event_log: Path | None) -> dict[str, Any]:
    extra: dict[str, Any] = {"store_path": str(spec.store), "durable": spec.durable}
    if event_log is not None:
        extra["event_log"] = str(event_log)
    if spec.storage_read_gbps:
        extra["storage_read_gbps"] = spec.storage_read_gbps
    if spec.blocks_per_file is not None:
        extra["blocks_per_file"] = spec.blocks_per_file
    if role == "decode":
        extra.update(side_channel=side_channel, staging_blocks=spec.staging_blocks)
    else:
        extra["async_loads"] = spec.async_loads
    return {"kv_connector": "DualPathConnector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


def server_command(spec: VllmClusterSpec, port: int, config: dict[str, Any],
                   chat_template: Path | None = None, host: str = "127.0.0.1") -> list[str]:
    template = ["--chat-template", str(chat_template)] if chat_template is not None else []
    eager = [] if spec.cuda_graphs else ["--enforce-eager"]
    parallel = ["--tensor-parallel-size", str(spec.tensor_parallel_size)] \
        if spec.tensor_parallel_size > 1 else []
    return [spec.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", spec.model, "--tokenizer", spec.model, "--dtype", spec.dtype,
            *eager, *parallel, "--no-enable-prefix-caching", "--seed", "0",
            "--max-model-len", str(spec.max_model_len), "--max-num-seqs", str(spec.max_num_seqs),
            "--host", host, "--port", str(port),
            "--kv-transfer-config", json.dumps(config), *template, *spec.extra_args]


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def reaped_command(cmd: list[str], tag: str, grace_s: float) -> list[str]:
    """`cmd` under a `reaper` of this interpreter (which has dualpath)."""
    return [sys.executable, "-m", reaper.__name__, "--tag", tag, "--parent", str(os.getpid()),
            "--grace", f"{grace_s:g}", "--", *cmd]


RESTART_BACKOFF_S = (1.0, 5.0, 15.0, 60.0)
"""Waits before restarting a server that died again soon after its last start (the n-th
quick death in a row waits the n-th; a server that ran a while restarts at once)."""
QUICK_DEATH_S = 120.0


class VllmCluster:
    """P prefill and D decode vLLM servers on one store (a context manager)."""

    def __init__(self, spec: VllmClusterSpec) -> None:
        if spec.num_prefill < 1 or spec.num_decode < 1:
            raise ValueError("a cluster needs at least one prefill and one decode instance")
        if spec.hosts not in HOST_MODES:
            raise ValueError(f"hosts must be one of {HOST_MODES}, not {spec.hosts!r}")
        self.spec = spec
        self.instances: list[Instance] = []
        self.hosts: netns.Hosts | None = None
        """The emulated hosts' bridge and namespaces (`hosts="netns"`)."""
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def prefill(self) -> list[Instance]:
        return [i for i in self.instances if i.role == "prefill"]

    @property
    def decode(self) -> list[Instance]:
        return [i for i in self.instances if i.role == "decode"]

    def start(self) -> VllmCluster:
        spec = self.spec
        spec.store.mkdir(parents=True, exist_ok=True)
        log_dir = spec.log_dir or spec.store.parent
        log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.kv_cache_gib))
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        template = spec.chat_template
        if template is None and not has_chat_template(spec.model):
            template = log_dir / "chatml.jinja"
            template.write_text(CHATML_TEMPLATE, encoding="utf-8")
        roles = ["prefill"] * spec.num_prefill + ["decode"] * spec.num_decode
        counts = {"prefill": 0, "decode": 0}
        binding = cpu_binding(spec, len(roles))
        taken: set[int] = set()
        try:
            if spec.hosts == "netns":
                why = netns.available()
                if why is not None:
                    raise LaunchError(f"hosts='netns' is not possible here: {why}")
                self.hosts = netns.Hosts()
                env.update(netns.HOST_ENV)
            for role, bind in zip(roles, binding, strict=True):
                name = f"{role}{counts[role]}"
                counts[role] += 1
                host = self.hosts.add() if self.hosts is not None else None
                address = host.address if host is not None else "127.0.0.1"
                port = free_port(taken)
                # A decode instance's ranks serve side channels on consecutive ports.
                is_stock = spec.stack == "vllm-stock"
                side = f"{address}:{free_ports(spec.tensor_parallel_size, taken)}" \
                    if role == "decode" and not is_stock else None
                events = log_dir / f"{name}.events.jsonl" \
                    if spec.event_logs and not is_stock else None
                log_path = log_dir / f"{name}.log"
                log = log_path.open("wb")
                config = stock.kv_transfer_config(
                    role, spec.store, spec.storage_read_gbps, spec.stock_fs_tier) \
                    if is_stock else kv_transfer_config(spec, role, side, events)
                cmd = server_command(spec, port, config, template, address)
                kv_events = None
                if spec.kv_events:
                    events_port = free_port(taken)
                    kv_events = f"tcp://{address}:{events_port}"
                    cmd += ["--kv-events-config", json.dumps({
                        "enable_kv_cache_events": True, "publisher": "zmq",
                        "endpoint": f"tcp://*:{events_port}"})]
                if host is not None:
                    cmd = host.command(cmd)
                tag = f"dp{os.getpid()}.{name}"
                command = reaped_command(cmd, tag, spec.stop_grace_s)
                inst_env = {**env, **bind, **spec.instance_gpus(len(self.instances))}
                if is_stock:
                    inst_env.update(stock.instance_env(address, free_port(taken)))
                self.instances.append(Instance(
                    name, role, port, side, self._popen(command, inst_env, log), log_path,
                    events, log, address, host.netns if host is not None else None,
                    bind.get("VLLM_CPU_OMP_THREADS_BIND", ""), tag, command, inst_env,
                    started_at=time.monotonic(), kv_events=kv_events))
            for inst in self.instances:
                self._wait_healthy(inst)
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _popen(command: list[str], env: dict[str, str], log: IO[bytes]
               ) -> subprocess.Popen[bytes]:
        """A server's reaper (a new session: the reaper leads the server's group)."""
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=_die_with_parent)

    def _respawn(self, inst: Instance) -> None:
        """Start `inst` again, as it was started (same ports, log appended)."""
        if inst._log is None:
            inst._log = inst.log_path.open("ab")
        inst.process = self._popen(inst.command, inst.env, inst._log)
        inst.started_at = time.monotonic()

    def _wait_healthy(self, inst: Instance) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while time.monotonic() < deadline:
            if self._stopping.is_set():
                raise LaunchError(f"{inst.name}: the cluster is stopping")
            if inst.process.poll() is not None:
                raise LaunchError(f"{inst.name} exited with {inst.process.returncode}:\n"
                                  f"{inst.log_tail()}")
            try:
                with urllib.request.urlopen(inst.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise LaunchError(f"{inst.name} not healthy after {self.spec.startup_timeout_s:.0f} s:"
                          f"\n{inst.log_tail()}")

    def stop(self, grace_s: float | None = None) -> None:
        """Every server down: its reaper is sent SIGTERM and takes its group down (SIGKILL
        after the grace period), then whatever is left of the group is killed here and the
        instance's shared memory swept (a reaper that was itself killed cleaned nothing)."""
        self._stopping.set()
        grace = self.spec.stop_grace_s if grace_s is None else grace_s
        with self._lock:
            for inst in self.instances:
                if inst.process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        inst.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace + 5.0
            for inst in self.instances:
                try:
                    inst.process.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    inst.process.kill()
                    inst.process.wait()
                self._clean_up(inst)
                if inst._log is not None:
                    inst._log.close()
                    inst._log = None
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(5.0)
        if self.hosts is not None:
            self.hosts.close()
            self.hosts = None

    def _clean_up(self, inst: Instance) -> list[str]:
        """After `inst`'s reaper ended: SIGKILL to any process left in its group, and its
        tagged shared memory removed; returns what was left (for a report)."""
        left = reaper.take_down(inst.process.pid, 0.0) if reaper.group_members(
            inst.process.pid) else []
        removed = reaper.sweep_shm(inst.tag)
        return [f"pid {p}" for p in left] + [f"/dev/shm/{n}" for n in removed]

    # -- supervision -----------------------------------------------------------------------
    def supervise(self, report: Callable[[str], None], restart: bool = True,
                  interval_s: float = 0.5) -> threading.Thread:
        """Watch the servers from a thread: a server that dies is reported (`report`, one
        line), its leftovers removed, and with `restart` started again on the same ports
        (with a backoff when it keeps dying soon after starting), its return reported."""

        def watch() -> None:
            while not self._stopping.wait(interval_s):
                for inst in self.instances:
                    if not inst.is_gone and inst.process.poll() is not None \
                            and not self._stopping.is_set():
                        self._on_death(inst, report, restart)

        self._supervisor = threading.Thread(target=watch, name="vllm-supervisor", daemon=True)
        self._supervisor.start()
        return self._supervisor

    def _on_death(self, inst: Instance, report: Callable[[str], None], restart: bool) -> None:
        code = inst.process.returncode
        ran_s = time.monotonic() - inst.started_at
        left = self._clean_up(inst)
        report(f"{inst.name} ({inst.url}) died after {ran_s:.0f} s: server "
               f"{reaper.describe_status(code)}"
               + (f"; removed what was left: {', '.join(left)}" if left else "")
               + ("" if restart else "; not restarted (--no-restart)"))
        if not restart:
            inst.is_gone = True
            return
        quick = inst.restarts if ran_s < QUICK_DEATH_S else 0
        wait_s = RESTART_BACKOFF_S[min(quick, len(RESTART_BACKOFF_S) - 1)] if quick else 0.0
        if wait_s:
            report(f"{inst.name}: restarting in {wait_s:g} s (it died {quick + 1} times in a "
                   f"row within {QUICK_DEATH_S:g} s of starting)")
        if self._stopping.wait(wait_s):
            return
        with self._lock:
            if self._stopping.is_set():
                return
            inst.restarts = quick + 1
            self._respawn(inst)
        t = time.monotonic()
        try:
            self._wait_healthy(inst)
        except LaunchError as e:
            if not self._stopping.is_set():
                report(f"{inst.name} did not come back: {str(e).splitlines()[0]}")
            return
        report(f"{inst.name} is back ({inst.url}) after {time.monotonic() - t:.0f} s")

    def __enter__(self) -> VllmCluster:
        # SIGTERM (a `timeout`, a CI runner) must still stop the servers: make it an exception
        # that unwinds through __exit__.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def describe(self) -> Iterator[str]:
        for inst in self.instances:
            side = f", side channel {inst.side_channel}" if inst.side_channel else ""
            where = f", netns {inst.netns}" if inst.netns else ""
            cpus = f", cores {inst.cpus}" if inst.cpus and inst.cpus != "nobind" else ""
            yield f"{inst.name:9s} {inst.url}{side}{where}{cpus}  (log {inst.log_path})"
