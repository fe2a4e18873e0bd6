"""Sweeps on a Ray cluster (`--ray ADDRESS`): every independent simulation one Ray task.

Ray is an optional extra (`pip install 'dualpath[ray]'`), imported here only when a sweep asks
for it. `RayBackend.connect` joins a cluster and checks, with one task pinned to each node, that
every node holds the same dualpath (version and a hash of its installed sources) as this
driver: a node that differs would give different results, so it is named and refused.

A task whose worker or node dies, or which raises a transient error (`RETRIED_ERRORS`), is
retried by Ray up to `MAX_RETRIES` times, on any node. After that it comes back as a
`TaskFailure` naming it, and the sweep goes on: its other results are kept. Any other
exception is not retried: a simulation is deterministic in its inputs, so it would raise again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import dualpath
from dualpath.core.errors import DualPathError

T = TypeVar("T")
R = TypeVar("R")

RAY_EXTRA = "pip install 'dualpath[ray]'"
MAX_RETRIES = 2
"""Ray retries a task this many times after its first try (so at most 3 tries)."""
RETRIED_ERRORS: tuple[type[BaseException], ...] = (OSError, MemoryError)
"""Exceptions of a task worth another try (a full disk, a node short of memory); a worker or
node that dies is always retried."""
CHECK_TIMEOUT_S = 120.0
"""How long the version check waits for a node (a fresh node starts its first worker)."""
RAY_HELP = ("run every independent simulation as a task on a Ray cluster: `auto` (the default: "
            "the cluster `ray start` made on this machine, or RAY_ADDRESS), HOST:PORT of its "
            "head, or `local` (a one-node Ray started for this run); needs "
            f"`{RAY_EXTRA}`; results are identical to a serial run")


class RayError(DualPathError):
    """Ray is missing, unreachable, or its nodes do not hold this dualpath."""


@dataclass(frozen=True)
class TaskFailure:
    """A task that failed on the cluster after Ray's retries."""

    name: str
    error: str
    """One line: the exception's type and message."""


@dataclass(frozen=True)
class NodeFingerprint:
    """What one node (or the driver) runs: the dualpath version and its sources' hash."""

    version: str
    sources: str
    """SHA-256 (hex, first 16 digits) of the package's .py and data files, by relative path."""
    hostname: str


def import_ray() -> Any:
    """The `ray` module, or a one-line error naming the extra to install."""
    try:
        import ray
    except ImportError as e:
        raise RayError(f"--ray needs Ray ({e}): {RAY_EXTRA}") from None
    return ray


@cache
def source_hash() -> str:
    """The hash of this process's installed dualpath sources (what decides its results)."""
    root = Path(dualpath.__file__).parent
    digest = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                   and (p.suffix == ".py" or p.parent.name == "data"))
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def fingerprint() -> NodeFingerprint:
    """This process's `NodeFingerprint` (run on every node by the version check)."""
    return NodeFingerprint(dualpath.__version__, source_hash(), socket.gethostname())


def mismatches(driver: NodeFingerprint, nodes: dict[str, NodeFingerprint | str]) -> list[str]:
    """One line per node (by its label) whose dualpath differs from the driver's, or whose
    check failed (the value is then the error)."""
    out = []
    for label, fp in nodes.items():
        if isinstance(fp, str):
            out.append(f"node {label}: the version check failed ({fp}); is this dualpath "
                       "installed there?")
        elif (fp.version, fp.sources) != (driver.version, driver.sources):
            out.append(f"node {label} ({fp.hostname}) holds dualpath {fp.version} (sources "
                       f"{fp.sources}), this driver {driver.version} (sources {driver.sources})")
    return out


PROBE_TIMEOUT_S = 5.0


def _probe(address: str) -> None:
    """Fail at once, by name, when nothing listens at a HOST:PORT address (Ray itself keeps
    retrying for minutes); `auto` and `local` are Ray's to resolve."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), PROBE_TIMEOUT_S).close()
    except OSError as e:
        raise RayError(f"--ray {address}: no Ray head answers there ({e})") from None


def _on_node(fn: Callable[[T], R], item: T) -> tuple[str, R]:
    """`fn(item)` and the id of the node it ran on (the task Ray runs)."""
    import ray

    return ray.get_runtime_context().get_node_id(), fn(item)


def _one_line(err: BaseException) -> str:
    """A Ray error as one line: the task's own exception where there is one."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        err = cause
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


class RayBackend:
    """A connection to a Ray cluster whose nodes all hold this dualpath; `imap` runs tasks."""

    def __init__(self, ray: Any, max_retries: int = MAX_RETRIES) -> None:
        self._ray = ray
        self.max_retries = max_retries
        self._labels: dict[str, str] = {}
        self._task: Any = None

    @classmethod
    def connect(cls, address: str, *, num_cpus: int | None = None,
                max_retries: int = MAX_RETRIES) -> RayBackend:
        """Join the cluster at `address` (`auto`, `host:port`, or `local` to start one here
        with `num_cpus`), then check its nodes' dualpath; a node that differs is named."""
        ray = import_ray()
        _probe(os.environ.get("RAY_ADDRESS") or address if address == "auto" else address)
        if ray.is_initialized():
            ray.shutdown()
        try:
            if address == "local":
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                         logging_level=logging.WARNING, log_to_driver=False)
            else:
                ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise RayError(f"--ray {address}: cannot join a Ray cluster: "
                           f"{_one_line(e)}") from None
        backend = cls(ray, max_retries)
        try:
            backend.check_nodes()
        except BaseException:
            backend.close()
            raise
        return backend

    def nodes(self) -> dict[str, str]:
        """Alive nodes: id -> label (its address)."""
        alive = {n["NodeID"]: str(n["NodeManagerAddress"]) for n in self._ray.nodes()
                 if n["Alive"]}
        self._labels.update(alive)
        return alive

    def label(self, node_id: str) -> str:
        """The address of node `node_id` (its id's start if it left the cluster unseen)."""
        if node_id not in self._labels:
            self.nodes()
        return self._labels.get(node_id, node_id[:12])

    def check_nodes(self) -> dict[str, NodeFingerprint]:
        """Run `fingerprint` on every alive node (one task pinned to each); raise naming each
        node whose dualpath differs from this driver's."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        probe = self._ray.remote(num_cpus=0, max_retries=0)(fingerprint)
        refs = {node_id: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                    node_id, soft=False)).remote() for node_id in self.nodes()}
        found: dict[str, NodeFingerprint | str] = {}
        for node_id, ref in refs.items():
            try:
                found[self.label(node_id)] = self._ray.get(ref, timeout=CHECK_TIMEOUT_S)
            except Exception as e:  # a node that cannot answer is reported, not raised
                found[self.label(node_id)] = _one_line(e)
        bad = mismatches(fingerprint(), found)
        if bad:
            raise RayError("the Ray cluster's nodes must hold this dualpath: " + "; ".join(bad))
        return {k: v for k, v in found.items() if isinstance(v, NodeFingerprint)}

    @property
    def num_cpus(self) -> int:
        return int(self._ray.cluster_resources().get("CPU", 0))

    def imap(self, fn: Callable[[T], R], items: Sequence[T],
             names: Sequence[str]) -> Iterator[tuple[int, R | TaskFailure, str]]:
        """`fn(item)` of every item as one task (named by `names`, one CPU each), submitted in
        order; yields (index, result or `TaskFailure`, node address) as each completes. Tasks
        still pending when the caller stops iterating are cancelled."""
        ray = self._ray
        if self._task is None:
            self._task = ray.remote(num_cpus=1, max_retries=self.max_retries,
                                    retry_exceptions=list(RETRIED_ERRORS))(_on_node)
        fn_ref = ray.put(fn)
        index = {self._task.options(name=name[:200]).remote(fn_ref, item): i
                 for i, (item, name) in enumerate(zip(items, names, strict=True))}
        pending = list(index)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                for ref in ready:
                    i = index[ref]
                    try:
                        node_id, value = ray.get(ref)
                    except ray.exceptions.RayError as e:
                        yield i, TaskFailure(names[i], _one_line(e)), ""
                    else:
                        yield i, value, self.label(node_id)
        finally:
            for ref in pending:
                ray.cancel(ref)

    def close(self) -> None:
        """Leave the cluster (a `local` one stops)."""
        self._ray.shutdown()


def join(address: str) -> RayBackend:
    """`RayBackend.connect(address)` for a command, saying on stderr what it joined."""
    started = time.perf_counter()
    backend = RayBackend.connect(address)
    nodes = backend.nodes()
    print(f"ray: {len(nodes)} node{'s' * (len(nodes) != 1)} ({', '.join(sorted(nodes.values()))}"
          f"), {backend.num_cpus} CPUs, each with dualpath {dualpath.__version__} (sources "
          f"{source_hash()}); joined in {time.perf_counter() - started:.1f} s",
          file=sys.stderr, flush=True)
    return backend
