"""Two traffic classes on an emulated host's Linux link: the analogue, between network
namespaces, of the fabric's virtual-lane arbitration (`fabric_qos`).

`LinkClasses.apply` gives a device's transmit side a hierarchical token bucket (HTB) of
`rate_mbit`: a high class guaranteed `high_weight / (high_weight + low_weight)` of the rate
and a low class the rest, each allowed to borrow up to the whole rate, the high one served
first (HTB prio 0). With the paper's 99:1 a busy collective stream keeps 99% and KV takes
whatever it leaves idle. The KV traffic is classified into the low class by its DSCP (the RoCE
traffic class `KVTrafficClass.traffic_class` marks) and by the TCP ports its UCX context
listens on (`KVTrafficClass.tcp_ports`: UCX's TCP transport marks no DSCP); everything else,
the collectives' DSCP included, is high, as the fabric's default lane is an inference lane.
`isolated=False` is the baseline: one FIFO class of the same rate for all traffic.

Needs root (CAP_NET_ADMIN in the namespace) and iproute2's `tc` with HTB and u32.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from dualpath.core.errors import SpecError
from dualpath.core.validate import positive, positive_int
from dualpath.transport.traffic_class import KVTrafficClass

HIGH, LOW, SHARED = "1:10", "1:20", "1:30"
"""HTB class ids: the high and low classes, the baseline's one class."""
QUANTUM_BYTES = 60_000
"""HTB's share of a round between classes of one priority (past HTB's 200 kB warning at
multi-gigabit rates, and above a jumbo frame)."""


class LinkError(RuntimeError):
    """A `tc` command failed (its error attached)."""


def _tc(netns: str | None, *args: str) -> str:
    cmd = ["tc", *(["-n", netns] if netns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise LinkError(f"`{' '.join(cmd)}` failed: {r.stderr.strip() or r.returncode}")
    return r.stdout


def port_mask(first: int, last: int) -> int:
    """The u32 mask that matches exactly the ports `first..last`: the range must be a
    power-of-two block aligned on its size."""
    size = last - first + 1
    if size & (size - 1) or first % size:
        raise SpecError("link_classes", "kv.tcp_ports", (first, last),
                        "must be a power-of-two block of ports aligned on its size "
                        "(e.g. 20000-20015)")
    return 0xFFFF & ~(size - 1)


@dataclass(frozen=True)
class LinkClasses:
    """A link's rate and how it splits it. Frozen, validated."""

    rate_mbit: float
    kv: KVTrafficClass
    """What marks KV: its DSCP (`traffic_class`) and its UCX TCP ports (`tcp_ports`)."""
    isolated: bool = True
    high_weight: int = 99
    low_weight: int = 1

    def __post_init__(self) -> None:
        positive("link_classes", "rate_mbit", self.rate_mbit)
        positive_int("link_classes", "high_weight", self.high_weight)
        positive_int("link_classes", "low_weight", self.low_weight)
        if self.kv.dscp is None and self.kv.tcp_ports is None:
            raise SpecError("link_classes", "kv", self.kv,
                            "needs a traffic_class (DSCP) or tcp_ports to classify KV by")
        if self.kv.tcp_ports is not None:
            port_mask(*self.kv.tcp_ports)

    def _kbit(self, share: float) -> str:
        return f"{max(1, round(self.rate_mbit * 1000 * share))}kbit"

    def commands(self, dev: str) -> list[list[str]]:
        """The `tc` arguments that set the link up, in order (after the root is cleared)."""
        root = ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb"]
        top = ["class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
               "rate", self._kbit(1.0), "quantum", str(QUANTUM_BYTES)]
        if not self.isolated:
            return [[*root, "default", "30"], top,
                    ["class", "add", "dev", dev, "parent", "1:1", "classid", SHARED, "htb",
                     "rate", self._kbit(1.0), "quantum", str(QUANTUM_BYTES)]]
        high = self.high_weight / (self.high_weight + self.low_weight)
        out = [[*root, "default", "10"], top]
        for classid, share, prio in ((HIGH, high, "0"), (LOW, 1.0 - high, "1")):
            out.append(["class", "add", "dev", dev, "parent", "1:1", "classid", classid,
                        "htb", "rate", self._kbit(share), "ceil", self._kbit(1.0),
                        "prio", prio, "quantum", str(QUANTUM_BYTES)])
        low_filter = ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio",
                      "1", "u32"]
        if self.kv.dscp is not None:
            out.append([*low_filter, "match", "ip", "dsfield", str(self.kv.dscp << 2), "0xfc",
                        "flowid", LOW])
        if self.kv.tcp_ports is not None:
            mask = hex(port_mask(*self.kv.tcp_ports))
            for side in ("sport", "dport"):
                out.append([*low_filter, "match", "ip", "protocol", "6", "0xff", "match", "ip",
                            side, str(self.kv.tcp_ports[0]), mask, "flowid", LOW])
        return out

    def apply(self, dev: str, netns: str | None = None) -> None:
        """Replace `dev`'s transmit qdisc (in `netns`) with these classes."""
        clear(dev, netns)
        for args in self.commands(dev):
            _tc(netns, *args)


def clear(dev: str, netns: str | None = None) -> None:
    """Back to the device's default qdisc (nothing to remove is fine)."""
    try:
        _tc(netns, "qdisc", "del", "dev", dev, "root")
    except LinkError as e:
        if "No such file" not in str(e) and "Cannot delete qdisc with handle of zero" \
                not in str(e) and "Invalid handle" not in str(e):
            raise


def sent_bytes(dev: str, netns: str | None = None) -> dict[str, int]:
    """Bytes each HTB class of `dev` has sent (`tc -s class show`), by class id."""
    out: dict[str, int] = {}
    classid = ""
    for line in _tc(netns, "-s", "class", "show", "dev", dev).splitlines():
        head = re.match(r"class htb (\S+) ", line)
        if head:
            classid = head.group(1)
        sent = re.match(r"\s*Sent (\d+) bytes", line)
        if sent and classid:
            out[classid] = int(sent.group(1))
    return out
