"""Real Ray nodes for the tests: `ray start --block` processes (a head, workers), each in a
process group of its own, on 127.0.0.1 or inside an emulated host (a network namespace)."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
STARTED = "Ray runtime started"


def cluster_env() -> dict[str, str]:
    """What every node and driver of one test cluster shares: its own token (nothing written
    to ~/.ray), and node-death detection in about 1.5 s instead of Ray's default 30 s."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
            "RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "3", "RAY_USAGE_STATS_ENABLED": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RayNode:
    """One `ray start --block` (head when `head_address` is empty) and its log."""

    proc: subprocess.Popen[bytes]
    log: Path
    netns: str = ""

    @classmethod
    def start(cls, log: Path, env: dict[str, str], ip: str, num_cpus: int, *,
              head_address: str = "", port: int = 6379, temp_dir: str = "",
              prefix: list[str] | None = None, timeout_s: float = 60.0,
              netns: str = "") -> RayNode:
        argv = [RAY, "start", "--block", f"--node-ip-address={ip}", f"--num-cpus={num_cpus}",
                "--disable-usage-stats"]
        if head_address:
            argv.append(f"--address={head_address}")
        else:
            argv += ["--head", f"--port={port}", "--include-dashboard=false",
                     f"--temp-dir={temp_dir}"]
        with open(log, "wb") as out:
            proc = subprocess.Popen([*(prefix or []), *argv], env={**os.environ, **env},
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        node = cls(proc, log, netns)
        deadline = time.monotonic() + timeout_s
        while STARTED not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                node.kill()
                raise RuntimeError(f"ray start failed: {log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)
        return node

    def kill(self) -> None:
        """SIGKILL to all its processes at once (a node that dies, not one that leaves): every
        process of its network namespace, else of its process group."""
        kill_all(self.netns, self.proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def kill_all(netns: str, pgid: int = 0) -> None:
    """SIGKILL every process of network namespace `netns` (else of process group `pgid`)."""
    cmd = ["ip", "netns", "pids", netns] if netns else ["pgrep", "-g", str(pgid)]
    for _ in range(3):
        pids = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.split()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.2)
