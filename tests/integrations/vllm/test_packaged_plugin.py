"""dualpath as a vLLM operator installs it: the wheel, the connector by name, the dashboard.

One 1P1D serves the tests here (SmolLM2 on CPU):
1. `python -m build` (in .venv) makes the sdist and the wheel; the wheel holds `dualpath/` and
   its metadata only, with the `vllm.general_plugins` entry point.
2. The wheel is installed, not editable, into a throwaway venv on top of the vLLM venv (a
   `.pth` line puts .venv-vllm's site-packages after its own; the checkout's editable install
   there is not processed): `dualpath` there is the wheel's, and vLLM's versions satisfy every
   requirement of `dualpath[vllm]`.
3. A prefill and a decode vLLM server of that venv start with `"kv_connector":
   "DualPathConnector"` and no module path (vLLM finds it through the wheel's plugin), and
   `dualpath route` of the wheel in front; two turns of one conversation go through it:
   turn 1's blocks are saved, turn 2 loads them (both read sides: the router runs in split
   mode).
4. Debian's Prometheus (`make deploy-tools`) scrapes the router and both servers; every PromQL
   expression of deploy/grafana/dualpath.json returns a series. With
   `DUALPATH_DASHBOARD_DATA=FILE`, the scraped series are written there for
   `tools/render_dashboard.py` (the picture in docs/vllm/observe.md).

Beside it, in this process: `plugin.register` twice, and the Kubernetes manifests'
kv-transfer configs resolved by vLLM. Skipped where vllm is not importable (`make vllm-test`
runs it in .venv-vllm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import time
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is installed only in .venv-vllm (make vllm-setup)")

from dualpath.integrations.vllm.cluster import reaper
from dualpath.integrations.vllm.cluster.launch import VllmCluster
from dualpath.integrations.vllm.cluster.ports import free_port
from dualpath.integrations.vllm.cluster.spec import VllmClusterSpec

REPO = Path(__file__).resolve().parents[3]
DASHBOARD = REPO / "deploy" / "grafana" / "dualpath.json"
KV_TRANSFER = REPO / "deploy" / "kubernetes" / "base" / "kv-transfer"
MAIN_PYTHON = REPO / ".venv" / "bin" / "python"
RATE_INTERVAL = "1m"
"""What Grafana's `$__rate_interval` stands for in these queries."""
FILLER = ("An agent keeps a long working context between its turns: the task, the files it read, "
          "the tools it called and what they returned. Each turn appends a short tool result "
          "and asks for the next step. ")


def deploy_tool(name: str) -> Path:
    named = os.environ.get("DUALPATH_DEPLOY_TOOLS")
    path = Path(named or REPO / ".cache" / "deb" / "usr" / "bin") / name
    if not path.exists():
        if named:
            pytest.fail(f"DUALPATH_DEPLOY_TOOLS={named} has no {name}: run make deploy-tools")
        pytest.skip(f"Debian's {name} is not unpacked here: run make deploy-tools")
    return path


def http_json(url: str, body: dict[str, Any] | None = None, timeout_s: float = 300
              ) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def wait_ok(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url} exited:\n{log.read_text(errors='replace')[-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not up in {timeout_s:.0f} s:\n"
                         f"{log.read_text(errors='replace')[-3000:]}")


@dataclass
class Deployed:
    dist: Path
    env_python: Path
    env_check: dict[str, Any]
    replies: list[dict[str, Any]]
    router_stats: dict[str, Any]
    metrics: dict[str, str]
    """Each server's `/metrics` page after the traffic (`prefill`, `decode`)."""
    prometheus: str


def build(out: Path) -> Path:
    proc = subprocess.run([str(MAIN_PYTHON), "-m", "build", "--no-isolation", "--outdir",
                           str(out), str(REPO)], capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


def throwaway_env(where: Path, wheel: Path) -> Path:
    """A venv whose own site-packages has the wheel, with .venv-vllm's after it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    site = where / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    (site / "vllm_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(where / "bin" / "python"),
                           "install", "-q", "--no-index", "--no-deps", str(wheel)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return where / "bin" / "python"


ENV_CHECK = textwrap.dedent("""
    import importlib.metadata as md, importlib.util, json
    from packaging.requirements import Requirement
    import dualpath
    dist = md.distribution("dualpath")
    unmet = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": "vllm"}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{req} (installed: {have})")
    (ep,) = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "dualpath"]
    connector = importlib.util.find_spec(
        "dualpath.integrations.vllm.connector.dualpath_connector")
    print(json.dumps({"dualpath_file": dualpath.__file__, "version": dist.version,
                      "connector_file": connector.origin,
                      "unmet": unmet, "entry_point": ep.value,
                      "entry_point_site": str(ep.dist.locate_file(""))}))
""")


def conversation_turns(router: str, model: str) -> list[dict[str, Any]]:
    """Two turns of one conversation: the second's prompt extends the first's."""
    messages = [{"role": "system", "content": FILLER * 12},
                {"role": "user", "content": "List the next three steps."}]
    body = {"model": model, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    first = http_json(router + "/v1/chat/completions", {**body, "messages": messages})
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "The tool returned: ok. Next step?"}]
    second = http_json(router + "/v1/chat/completions", {**body, "messages": messages})
    return [first, second]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    from dualpath.runtime.model.weights import smollm2_folder

    prometheus_bin = deploy_tool("prometheus")
    tmp = tmp_path_factory.mktemp("packaged")
    dist = build(tmp / "dist")
    (wheel,) = dist.glob("dualpath-*.whl")
    env_python = throwaway_env(tmp / "env", wheel)
    check = subprocess.run([str(env_python), "-c", ENV_CHECK], capture_output=True, text=True,
                           timeout=300, check=False, cwd=tmp)
    assert check.returncode == 0, check.stderr[-3000:]
    env_check = json.loads(check.stdout.strip().splitlines()[-1])
    spec = VllmClusterSpec(model=str(smollm2_folder()), store=tmp / "store",
                           python=str(env_python), log_dir=tmp / "logs", startup_timeout_s=600,
                           connector_by_name=True, served_model_name="SmolLM2-135M-Instruct")
    with VllmCluster(spec) as cluster:
        router_port, prom_port = free_port(), free_port()
        router = f"http://127.0.0.1:{router_port}"
        p, d = cluster.prefill[0], cluster.decode[0]
        route = [str(env_python), "-m", "dualpath.cli.main", "route", "--store", str(spec.store),
                 "--mode", "split", "--port", str(router_port), "--prefill", p.url,
                 "--decode", d.url, "--side", str(d.side_channel)]
        config = tmp / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {"job_name": "dualpath-router", "static_configs": [
                    {"targets": [f"127.0.0.1:{router_port}"]}]},
                {"job_name": "vllm", "static_configs": [
                    {"targets": [p.url.removeprefix("http://"),
                                 d.url.removeprefix("http://")]}]}]}))
        prom_cmd = [str(prometheus_bin), f"--config.file={config}",
                    f"--storage.tsdb.path={tmp / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}"]
        procs = []
        try:
            for name, cmd in (("router", route), ("prometheus", prom_cmd)):
                log = tmp / f"{name}.log"
                procs.append(subprocess.Popen(
                    reaper_command(cmd, name), stdout=log.open("wb"), stderr=subprocess.STDOUT,
                    start_new_session=True, cwd=tmp))
            wait_ok(router + "/health", procs[0], tmp / "router.log", 120)
            prometheus = f"http://127.0.0.1:{prom_port}"
            wait_ok(prometheus + "/-/ready", procs[1], tmp / "prometheus.log", 120)
            time.sleep(3)  # samples before the traffic
            replies = conversation_turns(router, spec.served_model_name or "")
            time.sleep(6)  # and after it, so that every rate has two
            metrics = {}
            for inst in (p, d):
                with urllib.request.urlopen(inst.url + "/metrics", timeout=30) as r:
                    metrics[inst.role] = r.read().decode()
            yield Deployed(dist, env_python, env_check, replies,
                           http_json(router + "/stats"), metrics, prometheus)
        finally:
            for proc in procs:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def reaper_command(cmd: list[str], name: str) -> list[str]:
    """`cmd` under a reaper: it ends with this test process, whatever ends that."""
    return [sys.executable, "-m", reaper.__name__, "--tag", f"dp{os.getpid()}.{name}",
            "--parent", str(os.getpid()), "--grace", "10", "--", *cmd]


def test_register_is_idempotent_and_the_manifests_configs_resolve_to_the_connector() -> None:
    """In this process (the checkout's dualpath): `register` twice, then vLLM resolves the
    Kubernetes manifests' kv-transfer configs, which name no module, to DualPathConnector."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from dualpath.integrations.vllm import plugin
    from dualpath.integrations.vllm.connector.dualpath_connector import DualPathConnector

    plugin.register()
    plugin.register()
    assert plugin.is_registered()
    assert KVConnectorFactory.get_connector_class_by_name(plugin.CONNECTOR_NAME) \
        is DualPathConnector
    configs = sorted(KV_TRANSFER.glob("*.json"))
    assert [c.name for c in configs] == ["decode.json", "prefill.json"]
    for path in configs:
        config = KVTransferConfig(**json.loads(path.read_text().replace("POD_IP", "10.0.0.7")))
        assert config.kv_connector_module_path is None
        assert KVConnectorFactory.get_connector_class(config) is DualPathConnector, path


def test_the_wheel_holds_the_package_only(deployed: Deployed) -> None:
    (wheel,) = deployed.dist.glob("dualpath-*.whl")
    (sdist,) = deployed.dist.glob("dualpath-*.tar.gz")
    assert sdist.stat().st_size > 0
    names = zipfile.ZipFile(wheel).namelist()
    version = deployed.env_check["version"]
    info = f"dualpath-{version}.dist-info/"
    stray = [n for n in names if not n.startswith(("dualpath/", info))]
    assert not stray, stray
    assert not [n for n in names if n.endswith((".so", ".c", "_compiled.json"))]
    assert "dualpath/py.typed" in names and "dualpath/data/storage_calibration.json" in names
    entry_points = zipfile.ZipFile(wheel).read(info + "entry_points.txt").decode()
    assert "[vllm.general_plugins]\ndualpath = dualpath.integrations.vllm.plugin:register" \
        in entry_points


def test_the_venv_runs_the_wheel_and_vllm_satisfies_its_requirements(
        deployed: Deployed) -> None:
    check = deployed.env_check
    env = str(deployed.env_python.parent.parent)
    assert check["dualpath_file"].startswith(env), check
    assert check["connector_file"].startswith(env), check
    assert check["entry_point_site"].startswith(env), check
    assert check["entry_point"] == "dualpath.integrations.vllm.plugin:register"
    assert check["unmet"] == [], check
    out = subprocess.run([str(deployed.env_python), "-m", "dualpath.cli.main", "--version"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"dualpath {check['version']}"


def _counter(page: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_the_connector_by_name_saves_and_loads(deployed: Deployed) -> None:
    first, second = deployed.replies
    assert first["usage"]["completion_tokens"] == 8 and second["usage"]["completion_tokens"] == 8
    saved = sum(_counter(page, "vllm:dualpath_saved_blocks_total")
                for page in deployed.metrics.values())
    loaded = _counter(deployed.metrics["prefill"], "vllm:dualpath_loaded_blocks_total")
    assert saved >= 1, "no block was saved"
    assert loaded >= 1, "turn 2 loaded no stored block"
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, second["usage"]
    assert second["model"] == "SmolLM2-135M-Instruct"
    stats = deployed.router_stats
    assert stats["requests_by_path"].get("split", 0) >= 1, stats["requests_by_path"]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, `$__rate_interval` filled in."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"].replace("$__rate_interval",
                                                               RATE_INTERVAL)))
    return out


def prom(base: str, path: str, **params: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    reply = http_json(url, timeout_s=30)
    assert reply["status"] == "success", reply
    result: list[dict[str, Any]] = reply["data"]["result"]
    return result


def test_every_dashboard_query_returns_a_series(deployed: Deployed) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 20
    empty = [(title, expr) for title, expr in queries
             if not prom(deployed.prometheus, "query", query=expr)]
    assert not empty, empty
    # The dashboard's read-path panels saw this test's traffic, not only zeros.
    loaded = prom(deployed.prometheus, "query",
                  query="sum(vllm:dualpath_loaded_blocks_total)")
    assert float(loaded[0]["value"][1]) >= 1
    out = os.environ.get("DUALPATH_DASHBOARD_DATA")
    if out:
        end = time.time()
        data = {expr: prom(deployed.prometheus, "query_range", query=expr,
                           start=f"{end - 40:.0f}", end=f"{end:.0f}", step="1")
                for _, expr in queries}
        Path(out).write_text(json.dumps({"rate_interval": RATE_INTERVAL, "series": data}))
