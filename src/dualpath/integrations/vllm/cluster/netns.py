"""Emulated hosts on one machine: one Linux network namespace per vLLM instance, each with its
own `eth0` (one end of a veth pair) plugged into a bridge in the root namespace, the "switch".

An instance in a namespace has its own loopback, its own ports and its own address on the
bridge's subnet, so the prefill and decode instances talk to each other (HTTP, the side
channel, NIXL) only over veth and TCP, as two hosts would; the router and the clients stay in
the root namespace and reach every "host" through the bridge. UCX is held to TCP in the
namespaces (`UCX_TLS=tcp,self`): left to itself it finds that every "host" is the same
machine and copies through shared memory or cross-process reads, which no real pair of hosts
could. The block store stays one shared folder (the 3FS or NFS mount of a real cluster).

Needs root (CAP_NET_ADMIN) and iproute2's `ip`; `available()` says whether this machine can.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

HOST_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}
"""What a process in an emulated host runs with (see the module docstring): UCX over TCP on
the host's `eth0` only (its loopback is not a way to another host)."""


class NetnsError(RuntimeError):
    """A namespace, veth pair or bridge that could not be set up (the `ip` error attached)."""


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {r.stderr.strip() or r.returncode}")


def available() -> str | None:
    """None when emulated hosts can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"dpprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except NetnsError as e:
        return str(e)
    with contextlib.suppress(NetnsError):
        _ip("netns", "del", probe)
    return None


@dataclass(frozen=True)
class Host:
    netns: str
    address: str
    """Its address on the bridge's subnet (bind servers here; peers reach it here)."""

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host (`ip netns exec` execs it: same pid, same signals)."""
        return ["ip", "netns", "exec", self.netns, *argv]


_made = itertools.count()
_NAME = re.compile(r"^dp(br|v)?((\d+)[a-z])(h\d+)?$")
"""The names `Hosts` makes: bridge `dpbr<tag>`, namespace `dp<tag>h<i>`, veth `dpv<tag>h<i>`,
where the tag is a pid and a letter."""


def _free_subnet(seed: int) -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no interface of the root namespace uses, picked from `seed`."""
    used = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True,
                          check=False).stdout
    for i in range(256):
        n = (seed + i * 7919) % 65536
        if f" 10.{n >> 8}.{n & 255}." not in used:
            return ipaddress.IPv4Network(f"10.{n >> 8}.{n & 255}.0/24")
    raise NetnsError("no free 10.x.y.0/24 subnet for the emulated hosts")


@dataclass
class Hosts:
    """A bridge and the namespaces plugged into it; `close()` removes them all."""

    tag: str = field(default_factory=lambda: f"{os.getpid()}{chr(97 + next(_made) % 26)}")
    """Part of every name: this process's pid and a letter per `Hosts` it made (no live
    process shares the pid, so whatever bears the tag was left by a run that is gone)."""
    bridge: str = ""
    subnet: ipaddress.IPv4Network | None = None
    hosts: list[Host] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.bridge = f"dpbr{self.tag}"
        self._remove_stale()
        self.subnet = _free_subnet(sum(ord(c) * 31 ** i for i, c in enumerate(self.tag)))
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.subnet.network_address + 1}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except NetnsError:
            self.close()
            raise

    def _is_stale(self, name: str) -> bool:
        """A name of this tag, or of a tag whose pid is no longer a live process: left by a
        killed run (SIGKILL skips `close`). (Runs in other pid namespaces that share this
        network namespace would look dead: emulated hosts assume one pid namespace.)"""
        if name == self.bridge or name.startswith((f"dp{self.tag}h", f"dpv{self.tag}h")):
            return True
        m = _NAME.match(name)
        if m is None:
            return False
        try:
            os.kill(int(m.group(3)), 0)
        except ProcessLookupError:
            return True
        except OSError:  # alive, someone else's
            return False
        return False

    def _remove_stale(self) -> None:
        """What killed runs left behind: namespaces, then veths and bridges."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                check=False).stdout
        for line in listed.splitlines():
            name = line.split(" ", 1)[0]
            if self._is_stale(name):
                with contextlib.suppress(NetnsError):
                    _ip("netns", "del", name)
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True,
                               check=False).stdout
        for line in links.splitlines():
            name = line.split(": ", 2)[1].split("@", 1)[0] if ": " in line else ""
            if self._is_stale(name):
                with contextlib.suppress(NetnsError):
                    _ip("link", "del", name)

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge (where the router is reached)."""
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    def add(self) -> Host:
        """A new emulated host: a namespace with `lo` and `eth0` up, on the bridge."""
        assert self.subnet is not None
        i = len(self.hosts)
        ns, veth = f"dp{self.tag}h{i}", f"dpv{self.tag}h{i}"
        host = Host(ns, str(self.subnet.network_address + 10 + i))
        _ip("netns", "add", ns)
        self.hosts.append(host)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", self.bridge, "up")
        _ip("addr", "add", f"{host.address}/24", "dev", "eth0", netns=ns)
        _ip("link", "set", "eth0", "up", netns=ns)
        _ip("link", "set", "lo", "up", netns=ns)
        _ip("route", "add", "default", "via", self.gateway, netns=ns)
        return host

    def close(self) -> None:
        """Remove the namespaces (their veth pairs go with them) and the bridge."""
        for i, host in enumerate(self.hosts):
            with contextlib.suppress(NetnsError):  # at once (a namespace goes lazily)
                _ip("link", "del", f"dpv{self.tag}h{i}")
            with contextlib.suppress(NetnsError):
                _ip("netns", "del", host.netns)
        self.hosts = []
        with contextlib.suppress(NetnsError):
            _ip("link", "del", self.bridge)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
