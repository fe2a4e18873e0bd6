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
import secrets
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from dualpath.integrations.vllm.cluster import netns, reaper, stock
from dualpath.integrations.vllm.cluster.command import (
    CHATML_TEMPLATE,
    has_chat_template,
    kv_transfer_config,
    reaped_command,
    server_command,
)
from dualpath.integrations.vllm.cluster.cpus import cpu_binding
from dualpath.integrations.vllm.cluster.ports import free_port, free_ports
from dualpath.integrations.vllm.cluster.spec import HOST_MODES, VllmClusterSpec
from dualpath.integrations.vllm.manifest import SIDE_CHANNEL_SECRET_ENV


class LaunchError(RuntimeError):
    """An instance that exited or did not become healthy in time (its log tail attached)."""


def _die_with_parent() -> None:
    """In the reaper before exec: SIGTERM when the process that started it dies (Linux
    prctl PR_SET_PDEATHSIG), so a killed driver never leaves servers running (the reaper
    takes its server's group down)."""
    reaper.die_with_parent(signal.SIGTERM)


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
    node: str = ""
    """The instance a data-parallel rank belongs to (its name when it has one rank): the
    router's node of engines."""

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


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


RESTART_BACKOFF_S = (1.0, 5.0, 15.0, 60.0)
"""Waits before restarting a server that died again soon after its last start (the n-th
quick death in a row waits the n-th; a server that ran a while restarts at once)."""
QUICK_DEATH_S = 120.0


class VllmCluster:
    """P prefill and D decode vLLM servers on one store (a context manager)."""

    def __init__(self, spec: VllmClusterSpec) -> None:
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
        # One side-channel secret per cluster (every instance inherits it): a decode node's
        # staging service serves only peers that hold it. Hosts joining one cluster export
        # the same one.
        env.setdefault(SIDE_CHANNEL_SECRET_ENV, secrets.token_hex(32))
        template = spec.chat_template
        if template is None and not has_chat_template(spec.model):
            template = log_dir / "chatml.jinja"
            template.write_text(CHATML_TEMPLATE, encoding="utf-8")
        dp = spec.data_parallel_size
        roles = ["prefill"] * spec.num_prefill * dp + ["decode"] * spec.num_decode * dp
        counts = {"prefill": 0, "decode": 0}
        dp_group: tuple[str, int] = ("", 0)
        """A data-parallel instance's rank 0 address and its ranks' RPC port."""
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
                node = f"{role}{counts[role] // dp}"
                rank = counts[role] % dp
                name = node if dp == 1 else f"{node}-r{rank}"
                counts[role] += 1
                host = self.hosts.add() if self.hosts is not None else None
                address = host.address if host is not None else spec.address or "127.0.0.1"
                # A decode instance's ranks serve side channels on consecutive ports.
                is_stock = spec.stack == "vllm-stock"
                has_side = role == "decode" and not is_stock
                if spec.address is None:
                    port = free_port(taken)
                    side_port = free_ports(spec.tensor_parallel_size, taken) if has_side else 0
                else:  # fixed ports, which a router elsewhere is given
                    port = spec.first_port + len(self.instances)
                    side_port = spec.first_side_port + spec.tensor_parallel_size * (
                        counts["decode"] - 1)
                side = f"{address}:{side_port}" if has_side else None
                events = log_dir / f"{name}.events.jsonl" \
                    if spec.event_logs and not is_stock else None
                log_path = log_dir / f"{name}.log"
                log = log_path.open("wb")
                config = stock.kv_transfer_config(
                    role, spec.store, spec.storage_read_gbps, spec.stock_fs_tier) \
                    if is_stock else kv_transfer_config(spec, role, side, events)
                if dp > 1 and rank == 0:
                    dp_group = (address, free_port(taken))
                cmd = server_command(spec, port, config, template,
                                     "0.0.0.0" if spec.address else address,
                                     (rank, *dp_group) if dp > 1 else None)
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
                    started_at=time.monotonic(), kv_events=kv_events, node=node))
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
