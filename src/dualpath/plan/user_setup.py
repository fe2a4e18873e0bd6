"""A user's own cluster and workload as a planning setup: `setup("cluster:FILE")`.

`dualpath advise` plans whatever `dualpath simulate` runs: a model config, a hardware preset with
overrides, tensor-parallel engines, a trajectory file or scaled Table-2 agents. Runs are named by
setup (`RunSpec.setup`) so that worker processes and Ray tasks rebuild them from the name alone;
this setup's name points at a JSON file that holds the whole spec (written once by
`write_user_setup`, read by every process), so the name stays short and the file is the
record of what was planned.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from dualpath.core.cluster import ClusterSpec
from dualpath.core.datafile import write_text_atomic
from dualpath.core.errors import DualPathError
from dualpath.core.hardware import HardwareSpec
from dualpath.core.model import AttentionKind, ModelSpec
from dualpath.core.units import GB
from dualpath.plan.setups import Setup
from dualpath.sim.workload import Workload, agent_workload

USER_PREFIX = "cluster:"
"""`setup("cluster:FILE")`: the cluster and workload written to FILE by `write_user_setup`."""


class UserSetupError(DualPathError, ValueError):
    """A cluster file that cannot be read back (names the file and the field)."""


@dataclass(frozen=True)
class WorkloadSpec:
    """How a user setup's agents are made; the trace and its cut come from `RunSpec.mal`."""

    trajectories: str = ""
    """A trajectory JSONL file (empty: Table-2 agents of the run's trace)."""
    append_factor: float = 1.0
    gen_factor: float = 1.0

    @property
    def is_default(self) -> bool:
        return not self.trajectories and self.append_factor == self.gen_factor == 1.0


def write_user_setup(path: Path, cluster: ClusterSpec, workload: WorkloadSpec) -> str:
    """Write the cluster (its P/D is the setup's default) and workload to `path`; returns the
    setup name that reads them back."""
    model = dataclasses.asdict(cluster.model)
    model["attention"] = cluster.model.attention.value
    data = {"model": model, "hardware": dataclasses.asdict(cluster.hardware),
            "tensor_parallel_size": cluster.tensor_parallel_size,
            "num_prefill_nodes": cluster.num_prefill_nodes,
            "num_decode_nodes": cluster.num_decode_nodes,
            "workload": dataclasses.asdict(workload)}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(data, indent=1) + "\n")
    return f"{USER_PREFIX}{path.resolve()}"


@cache
def _read(path: str) -> tuple[ClusterSpec, WorkloadSpec]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        model = dict(data["model"])
        model["attention"] = AttentionKind(model["attention"])
        cluster = ClusterSpec(HardwareSpec(**data["hardware"]), ModelSpec(**model),
                              int(data["num_prefill_nodes"]), int(data["num_decode_nodes"]),
                              int(data["tensor_parallel_size"]))
        return cluster, WorkloadSpec(**data["workload"])
    except OSError as exc:
        raise UserSetupError(f"{path}: cannot read ({exc.strerror})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise UserSetupError(f"{path}: not a cluster file written by advise ({exc})") from None


@dataclass(frozen=True)
class UserSetup(Setup):
    """The cluster and workload of a cluster file (`write_user_setup`)."""

    path: str = ""

    def cluster(
        self, num_prefill_nodes: int | None = None, num_decode_nodes: int | None = None
    ) -> ClusterSpec:
        base, _ = _read(self.path)
        return dataclasses.replace(base,
                                   num_prefill_nodes=num_prefill_nodes or base.num_prefill_nodes,
                                   num_decode_nodes=num_decode_nodes or base.num_decode_nodes)

    def workload(self, trace: str, max_len_tokens: int, num_agents: int, seed: int,
                 block_size: int) -> Workload | None:
        spec = _read(self.path)[1]
        if spec.is_default:
            return None
        if not spec.trajectories:
            return agent_workload(trace, num_agents, seed=seed, max_len_tokens=max_len_tokens,
                                  append_factor=spec.append_factor,
                                  gen_factor=spec.gen_factor, block_size=block_size)
        return _trajectory_agents(spec, max_len_tokens, num_agents, seed, block_size)


@cache
def _trajectory_agents(spec: WorkloadSpec, max_len_tokens: int, num_agents: int, seed: int,
                       block_size: int) -> Workload:
    """The file's trajectories as `num_agents` agents (more than it holds: expanded as the
    Table-2 traces are, paper A.3), scaled and cut at `max_len_tokens`."""
    from dualpath.workload.jsonl import load_trajectories
    from dualpath.workload.replay import expand_agents, scale_lengths
    from dualpath.workload.trajectory import TurnTable

    trajs = [scale_lengths(t, spec.append_factor, spec.gen_factor, max_len_tokens)
             for t in load_trajectories(spec.trajectories).trajectories]
    agents = expand_agents(trajs, num_agents, seed)
    return Workload.from_turn_table(TurnTable.from_trajectories([a.trajectory for a in agents],
                                                               block_size))


def user_setup(name: str) -> UserSetup:
    """The setup of `cluster:FILE`."""
    path = name[len(USER_PREFIX):]
    cluster, _ = _read(path)
    return UserSetup(name, cluster.model.name, cluster.num_prefill_nodes,
                     cluster.num_decode_nodes, cluster.hardware.dram_buffer_bytes / GB,
                     label=f"{cluster.model.name} on {cluster.hardware.name}"
                     + (f", TP {cluster.tensor_parallel_size}"
                        if cluster.tensor_parallel_size > 1 else ""),
                     hardware=cluster.hardware.name, path=path)

