"""`launch.VllmCluster` without vLLM: a stand-in `vllm.entrypoints.openai.api_server` (a tiny
HTTP server on the `--host`/`--port` it is given) shows what each instance is started with and
where it runs, on loopback and on emulated hosts (network namespaces, when this machine allows
them), and that stopping the cluster leaves no process, namespace or bridge behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from dualpath.core.errors import SpecError
from dualpath.integrations.vllm.cluster import netns
from dualpath.integrations.vllm.cluster.command import server_command
from dualpath.integrations.vllm.cluster.cpus import cpu_binding, cpu_sets
from dualpath.integrations.vllm.cluster.launch import LaunchError, VllmCluster
from dualpath.integrations.vllm.cluster.ports import free_ports
from dualpath.integrations.vllm.cluster.spec import VllmClusterSpec

STAND_IN = '''
import argparse, json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--host"); ap.add_argument("--port", type=int)
ap.add_argument("--kv-transfer-config")
args, _ = ap.parse_known_args()

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"netns": os.readlink("/proc/self/ns/net"),
                           "config": json.loads(args.kv_transfer_config),
                           "ucx_tls": os.environ.get("UCX_TLS"),
                           "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                           "omp": os.environ.get("OMP_NUM_THREADS"),
                           "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
                           "argv": sys.argv[1:]}).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a):
        pass

HTTPServer((args.host, args.port), H).serve_forever()
'''


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "fake" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(STAND_IN)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    return tmp_path


def spec(tmp: Path, hosts: str) -> VllmClusterSpec:
    return VllmClusterSpec(model=str(tmp), store=tmp / "store", python=sys.executable,
                       num_decode=2, hosts=hosts, startup_timeout_s=60)


def whoami(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/whoami", timeout=10) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def test_loopback_cluster_roles_and_side_channels(stand_in: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    with VllmCluster(spec(stand_in, "loopback")) as cluster:
        assert [i.name for i in cluster.instances] == ["prefill0", "decode0", "decode1"]
        for inst in cluster.instances:
            me = whoami(inst.url)
            assert me["netns"] == os.readlink("/proc/self/ns/net")
            extra = me["config"]["kv_connector_extra_config"]
            assert me["config"]["kv_role"] == ("kv_producer" if inst.role == "prefill"
                                               else "kv_consumer")
            if inst.role == "decode":
                assert extra["side_channel"] == inst.side_channel
                assert inst.side_channel is not None
                assert inst.side_channel.startswith("127.0.0.1:")
        sets = cpu_sets(3, sorted(os.sched_getaffinity(0)))
        binds = [whoami(i.url)["bind"] for i in cluster.instances]
        if sets is None:  # fewer cores than instances: none pinned, one thread each
            assert binds == ["nobind"] * 3
            assert {whoami(i.url)["omp"] for i in cluster.instances} == {"1"}
        else:
            assert binds == [",".join(map(str, c)) for c in sets]
        assert [i.cpus for i in cluster.instances] == binds
        procs = [i.process for i in cluster.instances]
    assert all(p.poll() is not None for p in procs)


def test_netns_cluster_puts_each_instance_on_its_own_host(stand_in: Path) -> None:
    why = netns.available()
    if why is not None:
        pytest.skip(why)
    with VllmCluster(spec(stand_in, "netns")) as cluster:
        assert cluster.hosts is not None
        names = {h.netns for h in cluster.hosts.hosts}
        seen = set()
        for inst in cluster.instances:
            me = whoami(inst.url)  # reached from this namespace, through the bridge
            assert inst.host != "127.0.0.1" and inst.netns in names
            assert me["netns"] != os.readlink("/proc/self/ns/net")
            assert me["ucx_tls"] == netns.HOST_ENV["UCX_TLS"]
            seen.add(me["netns"])
            if inst.role == "decode":
                assert inst.side_channel == (
                    me["config"]["kv_connector_extra_config"]["side_channel"])
                assert inst.side_channel is not None
                assert inst.side_channel.startswith(inst.host + ":")
        assert len(seen) == 3
        bridge = cluster.hosts.bridge
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not names & {line.split()[0] for line in listed.splitlines() if line.strip()}
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert bridge not in links


def test_a_bad_hosts_mode_is_refused(stand_in: Path) -> None:
    with pytest.raises(ValueError, match="hosts must be one of"):
        VllmCluster(spec(stand_in, "docker"))


def test_netns_refused_with_the_reason_when_unavailable(stand_in: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "available", lambda: "network namespaces need root")
    with pytest.raises(LaunchError, match="need root"):
        VllmCluster(spec(stand_in, "netns")).start()


def test_hosts_left_by_a_killed_run_are_replaced() -> None:
    """A run killed before `close` leaves its namespaces, veths and bridge; the next one with
    the same tag (a pid, so the owner is gone) removes them instead of failing."""
    why = netns.available()
    if why is not None:
        pytest.skip(why)
    stale = netns.Hosts(tag="99991z")
    stale.add()
    stale.add()
    with netns.Hosts(tag="99991z") as fresh:
        host = fresh.add()
        assert host.netns == "dp99991zh0"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "dp99991zh" not in listed
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "dpbr99991z" not in links and "dpv99991zh" not in links


def test_hosts_of_a_killed_run_are_removed_by_the_next() -> None:
    """A SIGKILLed driver cannot clean up; the next `Hosts` removes whatever bears the tag of
    a pid that is gone, and leaves a live process's alone."""
    why = netns.available()
    if why is not None:
        pytest.skip(why)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that is gone (reuse within this test is unlikely)
    dead = netns.Hosts(tag=f"{child.pid}q")
    dead.add()
    with netns.Hosts() as live:
        live.add()
        with netns.Hosts():
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True,
                                    text=True).stdout
            links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert f"dp{child.pid}qh0" not in listed and f"dpbr{child.pid}q" not in links
        assert f"dpv{child.pid}qh0" not in links
        assert live.hosts[0].netns in listed and live.bridge in links


def test_two_sets_of_hosts_in_one_process_do_not_meet() -> None:
    why = netns.available()
    if why is not None:
        pytest.skip(why)
    with netns.Hosts() as a, netns.Hosts() as b:
        ha, hb = a.add(), b.add()
        assert a.tag != b.tag and a.bridge != b.bridge and a.subnet != b.subnet
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert ha.netns in listed and hb.netns in listed


def test_cpu_sets_are_disjoint_runs_of_the_cores() -> None:
    assert cpu_sets(2, [0, 1]) == [[0], [1]]
    assert cpu_sets(3, [4, 0, 1, 2, 3, 5, 6]) == [[0, 1, 2], [3, 4], [5, 6]]
    assert cpu_sets(3, [0, 1]) is None
    assert cpu_sets(1, [0, 1]) == [[0, 1]]
    # Hyperthread siblings (cpu i and i + 4 on core i) stay in one set.
    assert cpu_sets(2, range(8), topology=lambda c: (0, c % 4)) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_cpu_binding_leaves_an_explicit_binding_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1|2-3")
    assert cpu_binding(spec(tmp_path, "loopback"), 3) == [{}, {}, {}]
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    off = VllmClusterSpec(model=str(tmp_path), store=tmp_path, python=sys.executable,
                      bind_cpus=False)
    assert cpu_binding(off, 2) == [{}, {}]
    tp = VllmClusterSpec(model=str(tmp_path), store=tmp_path, python=sys.executable,
                     extra_args=("--tensor-parallel-size", "2"))
    assert cpu_binding(tp, 2) == [{}, {}]  # one core list per rank: the environment's call
    assert all("VLLM_CPU_OMP_THREADS_BIND" in b for b in cpu_binding(spec(tmp_path, "x"), 2))


def test_the_cpu_command_line_is_unchanged(tmp_path: Path) -> None:
    cmd = server_command(spec(tmp_path, "loopback"), 8100, {})
    assert cmd[cmd.index("--dtype") + 1] == "float32" and "--enforce-eager" in cmd
    assert "--tensor-parallel-size" not in cmd


def test_a_gpu_cluster_gets_its_dtype_cuda_graphs_ranks_and_gpus(
        stand_in: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpu = VllmClusterSpec(model=str(stand_in), store=stand_in / "store", python=sys.executable,
                          num_decode=2, startup_timeout_s=60, dtype="bfloat16",
                          cuda_graphs=True, tensor_parallel_size=2,
                          gpus=("0", "1", "2", "3", "4", "5", "6"))
    with VllmCluster(gpu) as cluster:
        seen = [whoami(i.url) for i in cluster.instances]
        assert [me["gpus"] for me in seen] == ["0,1", "2,3", "4,5"]
        for me in seen:
            argv = me["argv"]
            assert argv[argv.index("--dtype") + 1] == "bfloat16"
            assert "--enforce-eager" not in argv
            assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
            assert me["bind"] is None or "VLLM_CPU_OMP_THREADS_BIND" in os.environ
        for inst in cluster.decode:  # rank 1's side channel port is free too
            assert inst.side_channel is not None
            port = int(inst.side_channel.rpartition(":")[2])
            assert port + 1 not in {int(i.side_channel.rpartition(":")[2])
                                    for i in cluster.decode if i is not inst
                                    and i.side_channel is not None}
    with pytest.raises(SpecError, match="need 6 GPUs"):
        VllmClusterSpec(model="m", store=stand_in, python="p", tensor_parallel_size=2,
                        num_decode=2, gpus=("0", "1", "2", "3", "4"))


def test_a_role_host_serves_on_fixed_ports_with_side_channels_at_its_address(
        stand_in: Path) -> None:
    first, first_side = free_ports(2), free_ports(4)
    role = VllmClusterSpec(model=str(stand_in), store=stand_in / "store", python=sys.executable,
                           num_prefill=0, num_decode=2, tensor_parallel_size=2,
                           address="127.0.0.1", first_port=first, first_side_port=first_side,
                           startup_timeout_s=60, bind_cpus=False, connector_by_name=True,
                           served_model_name="tiny-model")
    with VllmCluster(role) as cluster:
        assert [(i.role, i.url, i.side_channel) for i in cluster.instances] == [
            ("decode", f"http://127.0.0.1:{first}", f"127.0.0.1:{first_side}"),
            ("decode", f"http://127.0.0.1:{first + 1}", f"127.0.0.1:{first_side + 2}")]
        for inst in cluster.instances:
            me = whoami(inst.url)
            argv = me["argv"]
            assert argv[argv.index("--host") + 1] == "0.0.0.0"  # other hosts reach it
            assert argv[argv.index("--served-model-name") + 1] == "tiny-model"
            assert me["config"]["kv_connector"] == "DualPathConnector"
            assert "kv_connector_module_path" not in me["config"]
            assert me["config"]["kv_connector_extra_config"]["side_channel"] == inst.side_channel
    with pytest.raises(SpecError, match="at least one instance"):
        VllmClusterSpec(model="m", store=stand_in, python="p", num_prefill=0, num_decode=0)
    with pytest.raises(SpecError, match="hosts must be loopback"):
        VllmClusterSpec(model="m", store=stand_in, python="p", address="h", hosts="netns")


def _up(*argv: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "dualpath.cli.main", "vllm", "up", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def test_vllm_up_role_prints_the_router_arguments_and_keeps_the_logs(stand_in: Path) -> None:
    """`dualpath vllm up --role prefill` as on a prefill host: the servers start, the router's
    arguments for them come out on stdout; on Ctrl-C they stop and their logs stay in
    --log-dir, which was printed."""
    logs, first = stand_in / "logs", free_ports(2)
    up = _up("--role", "prefill", "--prefill", "2", "--address", "127.0.0.1", "--port",
             str(first), "--store", str(stand_in / "store"), "--model", str(stand_in),
             "--vllm-python", sys.executable, "--log-dir", str(logs),
             env={"DUALPATH_SIDE_CHANNEL_SECRET": "c" * 32})
    try:
        assert up.stdout is not None
        line = up.stdout.readline().split()
        assert line == ["--prefill", f"http://127.0.0.1:{first}",
                        "--prefill", f"http://127.0.0.1:{first + 1}"], up.stderr
        argv = whoami(line[1])["argv"]
        assert argv[argv.index("--served-model-name") + 1] == stand_in.name
    finally:
        up.send_signal(signal.SIGINT)
        _, err = up.communicate(timeout=60)
    assert up.returncode == 0, err
    assert f"logs in {logs.resolve()}" in err
    assert sorted(p.name for p in logs.glob("*.log")) == ["prefill0.log", "prefill1.log"]


@pytest.mark.parametrize(("argv", "field"), [
    (("--role", "decode", "--store", "/tmp/s"), "address"),
    (("--role", "decode", "--address", "h"), "store"),
    (("--decode", "0",), "prefill/decode"),
    (("--role", "decode", "--address", "h", "--store", "/tmp/s"),
     "export the same side-channel secret on every host"),
])
def test_vllm_up_refuses_a_bad_shape_naming_the_option(argv: tuple[str, ...],
                                                       field: str) -> None:
    env = {**os.environ}
    env.pop("DUALPATH_SIDE_CHANNEL_SECRET", None)
    up = subprocess.Popen([sys.executable, "-m", "dualpath.cli.main", "vllm", "up", *argv,
                           "--vllm-python", sys.executable], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env)
    _, err = up.communicate(timeout=60)
    assert up.returncode == 2 and field in err and err.count("\n") == 1, err
