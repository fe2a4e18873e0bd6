"""deploy/kubernetes: every overlay renders with Debian's kubectl (`kubectl kustomize`) and every
object validates offline against the Kubernetes schemas (`kubernetes-validate`, strict: no
unknown field), on the oldest and the newest Kubernetes the validator knows; then the shape
holds together: the router lists exactly the StatefulSets' pods, each decode pod with its side
channel, and the kv-transfer configs name the connector by its plugin name.

Nothing here runs a cluster. The renderer comes from `make deploy-tools` (Debian's
kubernetes-client, unpacked into .cache/deb; `DUALPATH_DEPLOY_TOOLS` names its bin folder):
never a kubectl that happens to be on the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dualpath.cli.main import build_parser
from dualpath.integrations.vllm.manifest import SIDE_CHANNEL_SECRET_ENV
from dualpath.integrations.vllm.plugin import CONNECTOR_NAME

if os.environ.get("DUALPATH_DEPLOY_TOOLS"):  # under make: the dev extras have both
    import kubernetes_validate
    import yaml
else:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[2]
KUSTOMIZE = REPO / "deploy" / "kubernetes"
SHAPES = {"1p1d": (1, 1), "2p4d": (2, 4)}
SCHEMA_VERSIONS = ("1.25.0", "1.37.0")
"""The oldest and the newest schemas kubernetes-validate 1.37 ships."""
SIDE_PORT = 9000


def kubectl() -> Path:
    """Debian's kubectl from `make deploy-tools`; a skip where it was never installed, a
    failure where the Makefile said it would be there."""
    named = os.environ.get("DUALPATH_DEPLOY_TOOLS")
    path = Path(named or REPO / ".cache" / "deb" / "usr" / "bin") / "kubectl"
    if not path.exists():
        if named:
            pytest.fail(f"DUALPATH_DEPLOY_TOOLS={named} has no kubectl: run make deploy-tools")
        pytest.skip("Debian's kubectl is not unpacked here: run make deploy-tools")
    return path


def render(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run([str(kubectl()), "kustomize", str(KUSTOMIZE / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


@pytest.mark.parametrize("overlay", sorted(SHAPES))
def test_overlay_renders_and_validates(overlay: str) -> None:
    objects = render(overlay)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["ConfigMap", "ConfigMap", "Deployment", "PersistentVolumeClaim",
                     "Service", "Service", "Service", "StatefulSet", "StatefulSet"], kinds
    for version in SCHEMA_VERSIONS:
        for obj in objects:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                raise AssertionError(f"{overlay}: {obj['kind']}/{obj['metadata']['name']} "
                                     f"against Kubernetes {version}: {e.message} at "
                                     f"{'.'.join(map(str, e.path))}") from None


@pytest.mark.parametrize("overlay", sorted(SHAPES))
def test_router_lists_every_pod_and_side_channel(overlay: str) -> None:
    objects = render(overlay)
    sets = by_kind(objects, "StatefulSet")
    num_prefill, num_decode = SHAPES[overlay]
    assert sets["dualpath-prefill"]["spec"]["replicas"] == num_prefill
    assert sets["dualpath-decode"]["spec"]["replicas"] == num_decode
    services = by_kind(objects, "Service")
    for role in ("prefill", "decode"):
        name = f"dualpath-{role}"
        assert sets[name]["spec"]["serviceName"] == name
        assert services[name]["spec"]["clusterIP"] == "None"  # stable pod names
    router = by_kind(objects, "Deployment")["dualpath-router"]
    (container,) = router["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["dualpath", "route"]
    args = build_parser().parse_args(["route", *container["args"]])
    pod = "http://dualpath-{role}-{i}.dualpath-{role}:8000"
    assert args.prefill == [pod.format(role="prefill", i=i) for i in range(num_prefill)]
    assert args.decode == [pod.format(role="decode", i=i) for i in range(num_decode)]
    assert args.side == [f"dualpath-decode-{i}.dualpath-decode:{SIDE_PORT}"
                         for i in range(num_decode)]
    assert services["dualpath-router"]["spec"]["ports"][0]["port"] == args.port


def test_servers_share_the_store_and_take_the_side_channel_host_from_the_pod_ip() -> None:
    objects = render("2p4d")
    (claim,) = by_kind(objects, "PersistentVolumeClaim").values()
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    configs = next(o for name, o in by_kind(objects, "ConfigMap").items()
                   if name.startswith("dualpath-kv-transfer"))["data"]
    for name, workload in [*by_kind(objects, "StatefulSet").items(),
                           *by_kind(objects, "Deployment").items()]:
        spec = workload["spec"]["template"]["spec"]
        claims = [v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]
                  if "persistentVolumeClaim" in v]
        assert claims == [claim["metadata"]["name"]], name
        if name == "dualpath-router":
            continue
        (container,) = spec["containers"]
        role = name.removeprefix("dualpath-")
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1", name
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env[SIDE_CHANNEL_SECRET_ENV]["valueFrom"]["secretKeyRef"] == {
            "name": "dualpath-side-channel", "key": "secret"}  # one secret for every pod
        assert f"/etc/dualpath/{role}.json" in container["args"][0]
        config = json.loads(configs[f"{role}.json"])
        assert config["kv_connector"] == CONNECTOR_NAME
        assert "kv_connector_module_path" not in config  # the plugin registers the name
        extra = config["kv_connector_extra_config"]
        assert extra["store_path"] == next(
            m["mountPath"] for m in container["volumeMounts"] if m["name"] == "store")
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        if role == "decode":
            assert extra["side_channel"] == f"POD_IP:{SIDE_PORT}"
            assert ports["side-channel"] == SIDE_PORT
        else:
            assert "side_channel" not in extra and "side-channel" not in ports
