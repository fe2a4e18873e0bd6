"""`--ray`: sweeps as Ray tasks on a real one-node cluster (`ray start` on 127.0.0.1) give the
serial results bit for bit; failed tasks are retried, then named, and the rest kept."""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from ray_nodes import RayNode, cluster_env, free_port

from dualpath.cli.main import main
from dualpath.plan.capacity import capacities
from dualpath.plan.ray_backend import (
    RAY_EXTRA,
    NodeFingerprint,
    RayBackend,
    TaskFailure,
    fingerprint,
    mismatches,
)
from dualpath.plan.runner import Runner, RunSpec
from dualpath.plan.section import Context
from dualpath.sim import SimResult

# Ray reads its settings (RAY_AUTH_MODE among them) when first imported: the fixture sets them
# before that, so this module does not import ray itself.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                reason=f"the ray extra is not installed ({RAY_EXTRA})")


@pytest.fixture(scope="module")
def ray_head() -> Iterator[str]:
    """A one-node Ray cluster (2 CPUs) on 127.0.0.1; its address. This process is its driver."""
    env = cluster_env()
    temp = tempfile.mkdtemp(prefix="dpray")  # short: Ray's socket paths must fit 107 bytes
    port = free_port()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        node = RayNode.start(Path(temp) / "head.log", env, "127.0.0.1", 2, port=port,
                             temp_dir=temp)
        try:
            yield f"127.0.0.1:{port}"
        finally:
            node.kill()
            shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def backend(ray_head: str) -> Iterator[RayBackend]:
    b = RayBackend.connect(ray_head)
    yield b
    b.close()


def same_bits(a: SimResult, b: SimResult) -> None:
    assert a.records.keys() == b.records.keys()
    for k in a.records:
        assert a.records[k].dtype == b.records[k].dtype
        assert a.records[k].tobytes() == b.records[k].tobytes(), k
    # repr prints every float exactly (shortest round-trip), so equal text = equal bits.
    assert repr(replace(a, records={})) == repr(replace(b, records={}))


def test_prefetch_on_ray_equals_serial_bit_for_bit(backend: RayBackend) -> None:
    specs = [RunSpec("ds27b_1p1d", m, n, "32k") for m in ("basic", "dualpath") for n in (3, 5)]
    specs.append(RunSpec("ds27b_1p1d", "dualpath", 4, "32k", num_prefill_nodes=1,
                         num_decode_nodes=2, storage=(1.0, 0.0)))
    serial, remote = Runner(), Runner(ray=backend)
    remote.prefetch(specs)
    assert len(remote.log) == len(specs) and not remote.failures
    for s in specs:
        same_bits(serial.run(s), remote.run(s))
    assert len(remote.log) == len(specs)  # served from the cache afterwards
    [node] = backend.nodes().values()  # Ray names 127.0.0.1 by the machine's address
    assert set(remote.node_of.values()) == {node}
    assert remote.where() == f"{len(specs)} on {node}"


def test_capacity_searches_on_ray_equal_serial(backend: RayBackend, tmp_path: Path) -> None:
    tasks = [("ds27b_1p1d", m, 0, None) for m in ("basic", "dualpath")]
    ctx = Context(tmp_path, online_duration_s=20.0)
    serial = capacities(ctx, tasks)
    remote = Context(tmp_path, Runner(ray=backend), online_duration_s=20.0)
    assert repr(capacities(remote, tasks)) == repr(serial)  # repr: NaN fields compare equal
    assert set(remote.runner.cache) == set(ctx.runner.cache)
    for spec in ctx.runner.cache:
        same_bits(ctx.runner.cache[spec], remote.runner.cache[spec])


def test_a_failing_task_is_named_after_its_try_and_the_rest_kept(
    backend: RayBackend, capsys: pytest.CaptureFixture[str]
) -> None:
    def half(x: int) -> int:
        if x == 3:
            raise ValueError(f"odd input {x}")
        return x // 2

    runner = Runner(ray=backend)
    got: dict[int, int] = {}
    failed = runner.fan_out(half, [2, 3, 4, 6], ["two", "three", "four", "six"],
                            lambda i, out, node: got.__setitem__(i, out))
    assert failed == [1]
    assert got == {0: 1, 2: 2, 3: 3}
    assert runner.failures == [TaskFailure("three", "ValueError: odd input 3")]
    assert "task 'three' failed on the cluster (ValueError: odd input 3)" in capsys.readouterr().err


def test_a_transient_error_is_retried_by_ray_then_named(backend: RayBackend,
                                                         tmp_path: Path) -> None:
    def flaky(x: int) -> int:
        tries = tmp_path / str(x)
        tries.mkdir(exist_ok=True)
        n = len(list(tries.iterdir()))
        (tries / str(n)).touch()
        if x < 0 or n < 2:
            raise OSError(f"disk hiccup {n}")
        return x + 1

    got = sorted(backend.imap(flaky, [41, -1], ["flaky", "broken"]),
                 key=lambda t: t[0])
    assert got == [(0, 42, *backend.nodes().values()),
                   (1, TaskFailure("broken", "OSError: disk hiccup 2"), "")]
    # Two retries (MAX_RETRIES) after the first try, for both.
    assert [len(list((tmp_path / x).iterdir())) for x in ("41", "-1")] == [3, 3]


def test_every_node_holds_this_dualpath(backend: RayBackend) -> None:
    assert backend.check_nodes() == {node: fingerprint() for node in backend.nodes().values()}


def test_a_differing_node_is_named() -> None:
    me = NodeFingerprint("0.1.0", "aaaa", "driver")
    found: dict[str, NodeFingerprint | str] = {
        "10.0.0.10": me, "10.0.0.11": NodeFingerprint("0.1.0", "bbbb", "w1"),
        "10.0.0.12": "ModuleNotFoundError: No module named 'dualpath'"}
    assert mismatches(me, found) == [
        "node 10.0.0.11 (w1) holds dualpath 0.1.0 (sources bbbb), this driver 0.1.0 "
        "(sources aaaa)",
        "node 10.0.0.12: the version check failed (ModuleNotFoundError: No module named "
        "'dualpath'); is this dualpath installed there?"]


def test_missing_ray_is_one_line_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` sees without the extra
    assert main(["reproduce", "fig8", "--ray", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith(RAY_EXTRA), err


def test_an_address_where_no_head_answers_is_one_line_at_once() -> None:
    # In a child process: this one imports ray only once the cluster fixture has set its token.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        r = subprocess.run([sys.executable, "-m", "dualpath.cli.main", "simulate", "--agents",
                            "2", "--ray", f"127.0.0.1:{port}"], capture_output=True, text=True,
                           timeout=60, check=False)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        f"dualpath simulate: error: --ray 127.0.0.1:{port}: no Ray head answers there "
        "([Errno 111] Connection refused)")


def test_simulate_modes_on_ray_equal_a_serial_run(ray_head: str, tmp_path: Path) -> None:
    def simulate(*extra: str) -> tuple[dict[str, object], str]:
        r = subprocess.run([sys.executable, "-m", "dualpath.cli.main", "simulate",
                            "--model", "ds-27b", "--agents", "6", "--trace", "32k",
                            "--mode", "basic,dualpath,oracle", "--json", *extra],
                           capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout), r.stderr

    serial, _ = simulate("--csv", str(tmp_path / "serial.csv"))
    remote, err = simulate("--csv", str(tmp_path / "ray.csv"), "--ray", ray_head)
    assert remote == serial
    assert err.count(" ran on ") == 3 and "ray: 1 node" in err
    for mode in ("basic", "dualpath", "oracle"):
        assert ((tmp_path / f"ray.{mode}.csv").read_bytes()
                == (tmp_path / f"serial.{mode}.csv").read_bytes())
