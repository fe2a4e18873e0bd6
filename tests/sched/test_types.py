"""Snapshot types: groups of whole nodes, request validation."""

from __future__ import annotations

import pytest

from dualpath.core.errors import SpecError
from dualpath.sched.types import EngineGroup, Role, WaitingRequest, groups_of_nodes


def test_groups_hold_whole_nodes_with_rank_zero_leader() -> None:
    groups = groups_of_nodes(Role.DECODE, [4, 5, 6], engines_per_node=2, nodes_per_group=2,
                             first_group_id=10)
    assert [g.group_id for g in groups] == [10, 11]
    assert groups[0].engine_ids == (8, 9, 10, 11) and groups[0].node_ids == (4, 5)
    assert groups[0].leader_engine_id == 8
    assert groups[1].engine_ids == (12, 13) and groups[1].role is Role.DECODE


def test_group_and_request_validation_names_the_field() -> None:
    with pytest.raises(SpecError, match="engine_ids"):
        EngineGroup(0, Role.PREFILL, (1, 1), {1: 0})
    with pytest.raises(SpecError, match="node_of_engine"):
        EngineGroup(0, Role.PREFILL, (1, 2), {1: 0})
    with pytest.raises(SpecError, match=r"request\[7\]\.hit_tokens=11"):
        WaitingRequest(7, prompt_tokens=10, hit_tokens=11, gen_tokens=0)
    assert WaitingRequest(7, 10, 4, 0).miss_tokens == 6
