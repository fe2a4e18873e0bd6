"""Checks and views of a group's engine reports shared by the PE and DE policies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dualpath.core.errors import SpecError
from dualpath.sched.types import EngineReport, Role


def check_reports(reports: Sequence[EngineReport], role: Role) -> None:
    """Raise SpecError unless `reports` is a valid snapshot of one `role` group: non-empty,
    one role, no engine twice, one read queue per node."""
    if not reports:
        raise SpecError("fetch", "reports", reports, "a group fetch needs at least one engine")
    seen: set[int] = set()
    node_q: dict[int, int] = {}
    for rep in reports:
        if rep.role is not role:
            raise SpecError(f"engine[{rep.engine_id}]", "role", rep.role.value,
                            f"a {role.value} fetch only takes {role.value} engines")
        if rep.engine_id in seen:
            raise SpecError(f"engine[{rep.engine_id}]", "engine_id", rep.engine_id,
                            "reported twice in one fetch")
        seen.add(rep.engine_id)
        if node_q.setdefault(rep.node_id, rep.read_q_tokens) != rep.read_q_tokens:
            raise SpecError(f"engine[{rep.engine_id}]", "read_q_tokens", rep.read_q_tokens,
                            f"differs from node {rep.node_id}'s other engines "
                            f"({node_q[rep.node_id]})")


def read_queues_by_node(
    reports: Sequence[EngineReport], others: Mapping[int, int] | None
) -> dict[int, int]:
    """Read queues by node: the caller's view of other nodes, overridden by this group's
    fresh reports."""
    queues = dict(others) if others else {}
    for rep in reports:
        queues[rep.node_id] = rep.read_q_tokens
    return queues
