"""A server's whole process tree and shared memory go with it, and `supervise` restarts it:
`launch.VllmCluster` over a stand-in `vllm.entrypoints.openai.api_server` that builds what a
vLLM server has (a child that ignores SIGTERM, as a hung engine may; a grandchild; a
`/dev/shm` segment named with the instance's tag, as the staging buffer is, and one not,
mapped by the child too, as vLLM's engine and worker map theirs), killed with SIGKILL the way
issue 28's probe killed a decode server."""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dualpath.integrations.vllm.cluster import reaper
from dualpath.integrations.vllm.cluster.launch import VllmCluster
from dualpath.integrations.vllm.cluster.ports import free_port
from dualpath.integrations.vllm.cluster.spec import VllmClusterSpec

STAND_IN = '''
import argparse, json, mmap, os, subprocess, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--host"); ap.add_argument("--port", type=int)
ap.add_argument("--kv-transfer-config")
args, _ = ap.parse_known_args()
if os.environ.get("STANDIN_MANIFEST"):  # what the connector publishes for the router
    from dualpath.integrations.vllm.manifest import StoreManifest
    StoreManifest(namespace="ab" * 16, model="m", block_size=4, full_block_bytes=64).write(
        json.loads(args.kv_transfer_config)["kv_connector_extra_config"]["store_path"])
maps = []
names = [f"dualpath-staging-{os.environ['DUALPATH_INSTANCE_TAG']}-{os.getpid()}",
         f"standin-{os.getpid()}"]
for name in names:  # mapped and kept, as vLLM's segments are (no resource tracker here)
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    maps.append(mmap.mmap(fd, 4096))
    os.close(fd)
child = subprocess.Popen([sys.executable, "-c", """
import mmap, os, signal, subprocess, sys, time
if os.environ.get("STANDIN_STUBBORN"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
fd = os.open(sys.argv[1], os.O_RDWR)  # mapped here too, as vLLM's engine maps its own
held = mmap.mmap(fd, 4096)
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
print(g.pid, flush=True)
time.sleep(3600)
""", f"/dev/shm/{names[1]}"], stdout=subprocess.PIPE, text=True)
tree = {"server": os.getpid(), "child": child.pid,
        "grandchild": int(child.stdout.readline()), "shm": names}
with open(os.path.join(os.environ["STANDIN_DIR"], f"{args.port}.json"), "w") as f:
    json.dump(tree, f)

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *a):
        pass

HTTPServer((args.host, args.port), H).serve_forever()
'''
WAIT_S = 30.0


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "fake" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(STAND_IN)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv("STANDIN_DIR", str(tmp_path))
    monkeypatch.setenv("STANDIN_STUBBORN", "1")
    return tmp_path


def spec(tmp: Path) -> VllmClusterSpec:
    return VllmClusterSpec(model=str(tmp), store=tmp / "store", python=sys.executable,
                           startup_timeout_s=60, stop_grace_s=1.0)


def tree(tmp: Path, port: int) -> dict[str, Any]:
    out: dict[str, Any] = json.loads((tmp / f"{port}.json").read_text())
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def gone(t: dict[str, Any]) -> bool:
    """No process of the tree runs and none of its segments is left."""
    return not any(alive(t[k]) for k in ("server", "child", "grandchild")) and not any(
        (reaper.SHM / n).exists() for n in t["shm"])


def wait_until(condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_a_killed_server_is_reported_restarted_and_leaves_nothing(stand_in: Path) -> None:
    reports: list[str] = []
    with VllmCluster(spec(stand_in)) as cluster:
        cluster.supervise(reports.append)
        d = cluster.decode[0]
        first = tree(stand_in, d.port)
        assert all(alive(first[k]) for k in ("server", "child", "grandchild"))
        assert all((reaper.SHM / n).exists() for n in first["shm"])
        assert d.tag in first["shm"][0]
        os.kill(first["server"], signal.SIGKILL)
        wait_until(lambda: any("is back" in r for r in reports))
        # The child ignored SIGTERM: the reaper SIGKILLed it after the 1 s grace.
        assert gone(first)
        assert reports[0].startswith(f"decode0 ({d.url}) died") and "SIGKILL" in reports[0]
        second = tree(stand_in, d.port)
        assert second["server"] != first["server"] and answers(d.url)
        assert d.restarts == 1
        assert "died" not in " ".join(reports[1:])  # the prefill instance was never touched
        log = d.log_path.read_text()
        assert "server killed by SIGKILL" in log and "SIGKILLed after 1 s" in log
    assert gone(second) and gone(tree(stand_in, cluster.prefill[0].port))


def test_without_restart_a_dead_server_is_reported_once(stand_in: Path) -> None:
    reports: list[str] = []
    with VllmCluster(spec(stand_in)) as cluster:
        cluster.supervise(reports.append, restart=False, interval_s=0.05)
        p = cluster.prefill[0]
        first = tree(stand_in, p.port)
        os.kill(first["server"], signal.SIGKILL)
        wait_until(lambda: bool(reports))
        wait_until(lambda: gone(first))
        time.sleep(0.5)
        assert len(reports) == 1 and "not restarted" in reports[0]
        assert not answers(p.url) and p.is_gone


def test_a_killed_launcher_leaves_no_server(stand_in: Path) -> None:
    launcher = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from pathlib import Path
from dualpath.integrations.vllm.cluster.launch import VllmCluster
from dualpath.integrations.vllm.cluster.ports import free_port
from dualpath.integrations.vllm.cluster.spec import VllmClusterSpec
tmp = Path({str(stand_in)!r})
spec = VllmClusterSpec(model=str(tmp), store=tmp / "store", python=sys.executable,
                       startup_timeout_s=60, stop_grace_s=1.0)
with VllmCluster(spec) as cluster:
    print(" ".join(str(i.port) for i in cluster.instances), flush=True)
    time.sleep(3600)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None
        ports = [int(x) for x in launcher.stdout.readline().split()]
        trees = [tree(stand_in, port) for port in ports]
        assert len(trees) == 2
        launcher.kill()  # no cleanup of its own: each reaper gets SIGTERM from the kernel
        launcher.wait()
        wait_until(lambda: all(gone(t) for t in trees))
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_sweep_removes_tagged_and_unheld_segments_only(tmp_path: Path) -> None:
    tag = f"dptest{os.getpid()}"
    names = [f"dualpath-staging-{tag}-1", f"standin-free-{os.getpid()}",
             f"standin-held-{os.getpid()}"]
    for n in names:
        (reaper.SHM / n).write_bytes(bytes(64))
    fd = os.open(reaper.SHM / names[2], os.O_RDWR)
    held = mmap.mmap(fd, 64)
    os.close(fd)
    try:
        assert names[2] in reaper.shm_in_use([os.getpid()])
        removed = reaper.sweep_shm(tag, names[1:])
        assert removed == sorted(names[:2])
        assert (reaper.SHM / names[2]).exists()
    finally:
        held.close()
        for n in names:
            (reaper.SHM / n).unlink(missing_ok=True)


def test_vllm_up_reports_and_restarts_a_dead_server_and_stops_clean(
        stand_in: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_MANIFEST", "1")
    monkeypatch.delenv("STANDIN_STUBBORN")  # `vllm up` waits its default 10 s for those
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dualpath.cli.main", "vllm", "up", "--vllm-python",
         sys.executable, "--model", str(stand_in), "--store", str(stand_in / "store"),
         "--port", str(port)], stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line.rstrip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_until(lambda: any(x.strip().startswith("decode0 ") for x in lines))
        url = next(x for x in lines if x.strip().startswith("decode0 ")).split()[1]
        decode_port = int(url.rstrip(",").rsplit(":", 1)[1])
        wait_until(lambda: answers(f"http://127.0.0.1:{port}"))
        trees = [tree(stand_in, decode_port)]
        os.kill(trees[0]["server"], signal.SIGKILL)
        wait_until(lambda: any("decode0 is back" in x for x in lines))
        assert any("decode0" in x and "died" in x and "SIGKILL" in x for x in lines)
        assert gone(trees[0])
        trees.append(tree(stand_in, decode_port))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(WAIT_S) == 0
        assert all(gone(t) for t in trees)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kv_events_get_a_port_per_instance(stand_in: Path) -> None:
    spec_ = VllmClusterSpec(model=str(stand_in), store=stand_in / "store",
                            python=sys.executable, startup_timeout_s=60, stop_grace_s=1.0,
                            kv_events=True)
    with VllmCluster(spec_) as cluster:
        ports = set()
        for inst in cluster.instances:
            assert inst.kv_events is not None and inst.kv_events.startswith("tcp://127.0.0.1:")
            port = inst.kv_events.rsplit(":", 1)[1]
            config = json.loads(inst.command[inst.command.index("--kv-events-config") + 1])
            assert config == {"enable_kv_cache_events": True, "publisher": "zmq",
                              "endpoint": f"tcp://*:{port}"}
            ports.add(port)
        assert len(ports) == 2
