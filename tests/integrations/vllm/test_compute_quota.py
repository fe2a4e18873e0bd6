"""The compute quota's settings as they travel to vLLM (`--additional-config`): they read back
the same, bad entries are refused naming the field, a step's prediction is the profile's."""

from __future__ import annotations

import json

import pytest

from dualpath.core.errors import SpecError
from dualpath.integrations.vllm.compute_quota import CONFIG_KEY, SCHEDULER_CLS, ComputeQuota
from dualpath.sched.profiled import ProfiledCosts

COSTS = ProfiledCosts(prefill_fixed_s=0.01, per_prefill_seq_s=0.02, per_new_token_s=0.002,
                      per_query_key_s=1e-6, per_cached_token_s=1e-5, decode_fixed_s=0.04,
                      per_seq_s=0.003, per_context_token_s=1e-5, source="test")


def test_settings_round_trip_through_the_server_arguments() -> None:
    quota = ComputeQuota(COSTS, quota_s=0.3, step_log="/tmp/steps.jsonl")
    args = quota.server_args()
    assert args[:2] == ["--scheduler-cls", SCHEDULER_CLS]
    back = ComputeQuota.from_additional_config(json.loads(args[3]))
    assert back == quota
    assert ComputeQuota.from_additional_config({}) is None
    assert quota.predict_s([(1000, 64), (0, 10)]) == COSTS.prefill_pass_time_s(
        [(1000, 64), (0, 10)])


@pytest.mark.parametrize(("entry", "field"), [
    ({"quota_s": 0.3}, "costs"),
    ({"quota_s": 0.3, "costs": {"prefill_fixed_s": 0.1}}, "costs"),
    ({"quota_s": -1, "costs": dict(ComputeQuota(COSTS).additional_config()[CONFIG_KEY]
                                  ["costs"])}, "quota_s"),
    ("300", CONFIG_KEY),
])
def test_a_bad_entry_is_refused_naming_its_field(entry: object, field: str) -> None:
    with pytest.raises(SpecError, match=field):
        ComputeQuota.from_additional_config({CONFIG_KEY: entry})
