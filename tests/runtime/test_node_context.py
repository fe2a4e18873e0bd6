"""A node's budgets (NIC rates, memory, prefill quota, estimator) are checked by one rule,
`node_context.check_budgets`, for the run (`RunConfig`) and for each node (`NodeConfig`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dualpath.core.errors import SpecError
from dualpath.runtime.kvlayout import KVLayout
from dualpath.runtime.model.model_source import ModelSource
from dualpath.runtime.node_context import NodeConfig
from dualpath.runtime.run_config import RunConfig

BAD = [
    ("storage_nic_bytes_per_s", 0.0),
    ("compute_nic_bytes_per_s", -1.0),
    ("buffer_bytes", 0),
    ("hbm_bytes", 0),
    ("compute_quota_s", 0.0),
    ("max_batch_tokens", 0),
    ("estimator", "guess"),
]


def node_config() -> NodeConfig:
    layout = KVLayout(num_layers=2, block_size=4, num_kv_heads=1, head_dim=4)
    return NodeConfig(node=0, is_prefill=True, num_engines=1, layout=layout,
                      model=ModelSource("tiny"), store_root=".", buffer_bytes=1 << 20,
                      storage_nic_bytes_per_s=1e6, compute_nic_bytes_per_s=1e6,
                      hbm_bytes=1 << 20, is_layerwise=True)


@pytest.mark.parametrize(("name", "value"), BAD)
def test_run_and_node_refuse_a_bad_budget_by_name(name: str, value: object) -> None:
    run = RunConfig(mode="dualpath", store_root=".")
    node = node_config()
    with pytest.raises(SpecError, match=rf"^run\.{name}="):
        replace(run, **{name: value})
    with pytest.raises(SpecError, match=rf"^node\[0\]\.{name}="):
        replace(node, **{name: value})
