"""Two traffic classes on an emulated host's link (tc HTB between real network namespaces):
packets with KV's DSCP or from KV's TCP ports leave through the low class, the collectives'
DSCP and unmarked traffic through the high one, and the baseline puts all in one class."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from dualpath.core.errors import SpecError
from dualpath.integrations.vllm.cluster import netns
from dualpath.transport.link_classes import HIGH, LOW, SHARED, LinkClasses, sent_bytes
from dualpath.transport.traffic_class import KVTrafficClass

KV = KVTrafficClass(traffic_class=72, tcp_ports=(20000, 20015))

SEND = textwrap.dedent("""
    import socket, sys
    peer, what = sys.argv[1], sys.argv[2]
    if what == "tcp":  # a SYN from a KV port (nobody listens: it is refused, but it left)
        s = socket.socket()
        s.bind(("", 20007))
        s.settimeout(2)
        try:
            s.connect((peer, 9))
        except OSError:
            pass
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        if what != "plain":
            s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, int(what))
        for _ in range(20):
            s.sendto(b"x" * 1000, (peer, 9999))
""")


@pytest.fixture()
def hosts() -> Iterator[netns.Hosts]:
    why = netns.available() if shutil.which("tc") else "iproute2's `tc` is not installed"
    if why:
        pytest.skip(f"emulated hosts unavailable: {why}")
    with netns.Hosts() as h:
        h.add()
        h.add()
        yield h


def _send(h: netns.Hosts, what: str) -> None:
    a, b = h.hosts
    subprocess.run(a.command([sys.executable, "-c", SEND, b.address, what]), check=True,
                   timeout=30)


def test_kv_leaves_through_the_low_class_the_rest_through_the_high(hosts: netns.Hosts) -> None:
    a = hosts.hosts[0]
    LinkClasses(rate_mbit=100, kv=KV).apply("eth0", a.netns)
    before = sent_bytes("eth0", a.netns)
    _send(hosts, "72")  # KV's DSCP 18
    mid = sent_bytes("eth0", a.netns)
    assert mid[LOW] - before[LOW] >= 20 * 1000 and mid[HIGH] - before[HIGH] < 2000
    _send(hosts, "104")  # the collectives' DSCP 26
    _send(hosts, "plain")
    after_udp = sent_bytes("eth0", a.netns)
    assert after_udp[HIGH] - mid[HIGH] >= 2 * 20 * 1000 and after_udp[LOW] == mid[LOW]
    _send(hosts, "tcp")
    after_tcp = sent_bytes("eth0", a.netns)
    assert after_tcp[LOW] > after_udp[LOW]  # the SYN (and its retries) from port 20007


def test_the_baseline_is_one_class_for_all(hosts: netns.Hosts) -> None:
    a = hosts.hosts[0]
    LinkClasses(rate_mbit=100, kv=KV, isolated=False).apply("eth0", a.netns)
    _send(hosts, "72")
    _send(hosts, "104")
    sent = sent_bytes("eth0", a.netns)
    assert HIGH not in sent and LOW not in sent and sent[SHARED] >= 2 * 20 * 1000


def test_commands_split_the_rate_by_the_weights() -> None:
    cmds = LinkClasses(rate_mbit=1000, kv=KV).commands("eth0")
    rates = {c[7]: (c[c.index("rate") + 1], c[c.index("ceil") + 1])
             for c in cmds if c[:2] == ["class", "add"] and "ceil" in c}
    assert rates == {HIGH: ("990000kbit", "1000000kbit"), LOW: ("10000kbit", "1000000kbit")}


def test_an_unaligned_port_range_is_refused() -> None:
    with pytest.raises(SpecError, match="tcp_ports"):
        LinkClasses(rate_mbit=100, kv=KVTrafficClass(tcp_ports=(20001, 20016)))
