"""The KV traffic class: its settings reach the UCX context of the NIXL agent given it and no
other (read back from NIXL's backend parameters, UCX's own log of the settings it applies per
context, and the ports UCX listens on), and the process's NCCL/UCX variables stay as they were;
bad values are refused naming their key."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from dualpath.core.errors import SpecError
from dualpath.transport.traffic_class import KVTrafficClass

PORTS = (20000, 20015)
"""Below Linux's ephemeral ports (32768-60999 by default): an OS-picked port is never in it."""

PROBE = textwrap.dedent(f"""
    import json, os, re
    import numpy as np
    from dualpath.transport.nixl import NixlAgent, agent_name
    from dualpath.transport.traffic_class import KVTrafficClass

    env_before = {{k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "UCX_"))}}
    kv = NixlAgent(agent_name("kv"), progress_thread=True, traffic_class=KVTrafficClass(
        ib_sl=2, traffic_class=72, tcp_ports={PORTS!r}))
    other = NixlAgent(agent_name("other"), progress_thread=False)
    there, here = np.full(1 << 16, 7, np.uint8), np.zeros(1 << 16, np.uint8)
    kv.register([(there.ctypes.data, there.nbytes)])
    other.register([(here.ctypes.data, here.nbytes)])
    peer = other.connect(kv.metadata())
    moved = other.transfer("READ", peer, [(here.ctypes.data, there.ctypes.data, here.nbytes)])
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            m = re.match(r"socket:\\[(\\d+)\\]", os.readlink("/proc/self/fd/" + fd))
        except OSError:
            continue
        if m:
            inodes.add(m.group(1))
    listening = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[9] in inodes and f[3] == "0A":
                listening.append(int(f[1].rsplit(":", 1)[1], 16))
    print("RESULT " + json.dumps({{
        "kv": kv.name, "other": other.name, "moved": moved, "ok": bool((here == 7).all()),
        "kv_params": kv.backend_params(), "other_params": other.backend_params(),
        "listening": listening, "env_before": env_before,
        "env_after": {{k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "UCX_"))}},
    }}))
""")


def test_settings_reach_the_kv_agent_only_and_leave_nccl_alone() -> None:
    pytest.importorskip("nixl", reason="nixl (UCX) is part of make setup")
    env = {**os.environ, "NCCL_IB_SL": "0", "NCCL_IB_TC": "104", "UCX_TLS": "tcp,self",
           "UCX_LOG_LEVEL": "debug"}  # UCX logs the settings it applies to each context
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    got = json.loads(line[len("RESULT "):])
    assert got["moved"] == 1 << 16 and got["ok"]

    # What NIXL created the KV agent's UCX backend with; the other agent's has none.
    assert got["kv_params"]["engine_config"] == \
        "IB_SL=2,IB_TRAFFIC_CLASS=72,TCP_PORT_RANGE=20000-20015"
    assert "engine_config" not in got["other_params"]

    # UCX applied the settings when the KV context opened its transports, and only there:
    # its log names each context ("ctx: <agent>") before the lines about it.
    log = r.stdout + r.stderr
    applied: dict[str, list[str]] = {}
    context = ""
    for text in log.splitlines():
        named = re.search(r"\(ctx: ([\w-]+)\)", text)
        if named:
            context = named.group(1)
        hit = re.search(r"apply UCT configuration (\S+)", text)
        if hit:
            applied.setdefault(context, []).append(hit.group(1))
    assert set(applied) == {got["kv"]}, applied
    assert "TCP_PORT_RANGE=20000-20015" in applied[got["kv"]]

    # The effect: the KV context listens inside its range, the other one outside it.
    inside = [p for p in got["listening"] if PORTS[0] <= p <= PORTS[1]]
    outside = [p for p in got["listening"] if not PORTS[0] <= p <= PORTS[1]]
    assert inside and outside, got["listening"]

    # Nothing was put into the environment: NCCL keeps its own classes.
    assert got["env_after"] == got["env_before"]
    assert got["env_after"]["NCCL_IB_SL"] == "0" and got["env_after"]["NCCL_IB_TC"] == "104"
    assert not any(k.startswith("UCX_IB") for k in got["env_after"])


def test_backend_params_and_extra_config_round_trip() -> None:
    kv = KVTrafficClass(ib_sl=2, traffic_class=72)
    assert kv.dscp == 18
    assert kv.backend_params() == {"engine_config": "IB_SL=2,IB_TRAFFIC_CLASS=72"}
    extra = kv.extra_config()
    assert extra == {"kv_ib_sl": 2, "kv_traffic_class": 72}
    assert KVTrafficClass.from_extra_config(lambda k, d: extra.get(k, d)) == kv
    assert KVTrafficClass().backend_params() == {} and KVTrafficClass().is_default


@pytest.mark.parametrize(("key", "value"), [("kv_ib_sl", 16), ("kv_ib_sl", -1),
                                            ("kv_traffic_class", 256), ("kv_ib_sl", "two"),
                                            ("kv_traffic_class", 7.5), ("kv_ib_sl", True)])
def test_a_bad_value_is_refused_naming_its_key(key: str, value: object) -> None:
    with pytest.raises(SpecError, match=f"kv_connector_extra_config.{key}="):
        KVTrafficClass.from_extra_config(lambda k, d: value if k == key else d)


def test_a_bad_port_range_is_refused() -> None:
    with pytest.raises(SpecError, match="tcp_ports"):
        KVTrafficClass(tcp_ports=(20015, 20000))
