"""Cores for the instances of one machine: each vLLM worker bound to a set of its own
(`VllmClusterSpec.bind_cpus`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from dualpath.integrations.vllm.cluster.spec import VllmClusterSpec


def _topology(cpu: int) -> tuple[int, int]:
    """(socket, physical core) of a logical CPU, from sysfs ((0, cpu) where it is missing)."""
    base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return (int((base / "physical_package_id").read_text()),
                int((base / "core_id").read_text()))
    except (OSError, ValueError):
        return (0, cpu)


def cpu_sets(num_instances: int, cpus: Sequence[int],
             topology: Callable[[int], tuple[int, int]] = _topology
             ) -> list[list[int]] | None:
    """`cpus` split into `num_instances` disjoint runs, in (socket, physical core, id) order
    so that hyperthread siblings stay together and an instance stays on one socket where it
    can; the earlier instances take the remainder. None when there are fewer cores than
    instances."""
    cpus = sorted(cpus, key=lambda c: (*topology(c), c))
    if num_instances < 1 or len(cpus) < num_instances:
        return None
    size, extra = divmod(len(cpus), num_instances)
    sets, lo = [], 0
    for i in range(num_instances):
        hi = lo + size + (1 if i < extra else 0)
        sets.append(sorted(cpus[lo:hi]))
        lo = hi
    return sets


def cpu_binding(spec: VllmClusterSpec, num_instances: int) -> list[dict[str, str]]:
    """The environment that binds each instance's vLLM worker (`VllmClusterSpec.bind_cpus`):
    `VLLM_CPU_OMP_THREADS_BIND` to a core set of its own; with fewer cores than instances,
    no binding and one OpenMP thread each (they share the cores, none is pinned). An instance
    of several ranks (tensor or pipeline parallel in `extra_args`) needs one list per rank:
    then the binding is left to the environment."""
    parallel = spec.tensor_parallel_size > 1 or any(a.startswith(
        ("--tensor-parallel-size", "--pipeline-parallel-size", "-tp", "-pp"))
        for a in spec.extra_args)
    if not spec.bind_cpus or parallel or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return [{} for _ in range(num_instances)]
    sets = cpu_sets(num_instances, list(os.sched_getaffinity(0)))
    if sets is None:
        return [{"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
                for _ in range(num_instances)]
    return [{"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))} for cores in sets]
