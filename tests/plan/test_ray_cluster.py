"""`--ray` on a real two-node Ray cluster: a head and a worker, each on an emulated host of its
own (a network namespace on a bridge, `netns.Hosts`). A `reproduce` section runs across both
and equals the serial run; the worker dies mid-sweep and the sweep finishes on the head with
the same results; a node holding other dualpath sources is named and refused."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from ray_nodes import RayNode, cluster_env, kill_all

import dualpath
from dualpath.integrations.vllm.cluster import netns
from dualpath.plan.ray_backend import RAY_EXTRA

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                reason=f"the ray extra is not installed ({RAY_EXTRA})")

DUALPATH = str(Path(sys.executable).with_name("dualpath"))
SECTION = ["reproduce", "fig8", "--quick", "--agents", "48,96"]
"""12 runs (2 agent counts x 3 P/D x 2 modes) of 0.5-2 s each here."""
PORT = 6379


@dataclass
class Cluster:
    hosts: netns.Hosts
    head: RayNode
    head_host: netns.Host
    env: dict[str, str]
    temp: Path

    @property
    def address(self) -> str:
        return f"{self.head_host.address}:{PORT}"

    def add_worker(self, name: str, extra_env: dict[str, str] | None = None) -> tuple[RayNode,
                                                                                      netns.Host]:
        host = self.hosts.add()
        node = RayNode.start(self.temp / f"{name}.log", {**self.env, **(extra_env or {})},
                             host.address, 1, head_address=self.address,
                             prefix=host.command([]), netns=host.netns)
        return node, host

    def driver(self, argv: list[str]) -> subprocess.Popen[str]:
        """`argv` run on the head's host (a Ray driver runs on a node of its cluster)."""
        return subprocess.Popen(self.head_host.command(argv), env={**os.environ, **self.env},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A Ray head (1 CPU) on an emulated host; workers join with `add_worker`."""
    why = netns.available()
    if why is not None:
        pytest.skip(f"emulated hosts unavailable: {why}")
    temp = Path(tempfile.mkdtemp(prefix="dpray"))  # short: Ray's socket paths must fit 107 bytes
    env = cluster_env()
    with netns.Hosts() as hosts:
        head_host = hosts.add()
        head = RayNode.start(temp / "head.log", env, head_host.address, 1, port=PORT,
                             temp_dir=str(temp / "ray"), prefix=head_host.command([]),
                             netns=head_host.netns)
        c = Cluster(hosts, head, head_host, env, temp)
        try:
            yield c
        finally:
            # Every process of each emulated host (the nodes, their workers, any driver).
            for h in hosts.hosts:
                kill_all(h.netns)
            head.kill()
            shutil.rmtree(temp, ignore_errors=True)


def _runs(line: str) -> str | None:
    """The node of a per-run progress line (`...: JCT ... s wall on ADDRESS`), else None."""
    return line.rsplit(" on ", 1)[1].strip() if " s wall on " in line else None


def test_sweep_across_two_hosts_equals_serial_and_survives_the_worker_dying(
    cluster: Cluster, tmp_path: Path
) -> None:
    serial = subprocess.Popen([DUALPATH, *SECTION, "--jobs", "1", "--quiet", "--out",
                               str(tmp_path / "serial")], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    worker, worker_host = cluster.add_worker("worker")
    head_ip = cluster.head_host.address
    driver = cluster.driver([DUALPATH, *SECTION, "--ray", cluster.address, "--out",
                             str(tmp_path / "ray")])
    assert driver.stderr is not None
    before: list[str] = []
    after: list[str] = []
    lines = []
    for line in driver.stderr:
        lines.append(line)
        node = _runs(line)
        if node is None:
            continue
        (after if worker.proc.poll() is not None else before).append(node)
        if node == worker_host.address and worker.proc.poll() is None:
            worker.kill()  # mid-sweep: its next task is running (a node dies, nothing is said)
    out, _ = driver.communicate(timeout=120)
    err = "".join(lines)
    assert driver.returncode == 0, err
    assert "ray: 2 nodes" in err
    assert worker_host.address in before and len(before) < 12, err  # both nodes, then the kill
    assert len(before) + len(after) == 12
    # The sweep finished on the head (the first line after the kill may be the worker's last).
    assert head_ip in after and set(after[1:]) <= {head_ip}, err
    assert serial.wait(timeout=120) == 0, serial.stderr.read() if serial.stderr else ""
    assert ((tmp_path / "ray" / "fig8.csv").read_bytes()
            == (tmp_path / "serial" / "fig8.csv").read_bytes())
    assert f"{head_ip}" in out and "failed on the cluster" not in out


def test_a_node_with_other_dualpath_sources_is_named(cluster: Cluster, tmp_path: Path) -> None:
    # The same version, one source file changed: this node would compute other results.
    other = tmp_path / "other"
    shutil.copytree(Path(dualpath.__file__).parent, other / "dualpath",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(other / "dualpath" / "reproduce" / "paper.py", "a", encoding="utf-8") as f:
        f.write("\n# changed on one node only\n")
    node, host = cluster.add_worker("other", {"PYTHONPATH": str(other)})
    try:
        driver = cluster.driver([DUALPATH, *SECTION, "--ray", cluster.address, "--out",
                                 str(tmp_path / "out")])
        _, err = driver.communicate(timeout=120)
    finally:
        node.kill()
    assert driver.returncode == 2, err
    [line] = [e for e in err.splitlines() if "error" in e]
    assert f"node {host.address} " in line and "holds dualpath" in line, err
    assert f"node {cluster.head_host.address} " not in line
