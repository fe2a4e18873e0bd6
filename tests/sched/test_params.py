"""alpha/beta derivation and validation of the scheduler parameters."""

from __future__ import annotations

import pytest

from dualpath.core.errors import SpecError
from dualpath.core.hardware import hardware_preset
from dualpath.core.model import model_preset
from dualpath.sched.cost import coefficients_for, prefill_tokens_per_s
from dualpath.sched.params import PathMode, TokCharge, derive_scheduler_params

H800 = hardware_preset("h800-deepseek")
V32 = model_preset("deepseek-v3.2")


def test_alpha_is_three_seconds_of_storage_nic_reads() -> None:
    p = derive_scheduler_params(V32, H800)
    assert p.alpha_tokens == pytest.approx(50e9 * 3 / V32.kv_bytes_per_token)
    assert p.kv_bytes_per_token == V32.kv_bytes_per_token
    assert (p.z_factor, p.compute_quota_s, p.path_mode) == (1.05, 0.3, PathMode.DUAL)


def test_beta_is_five_seconds_of_one_gpu_prefill_in_tok_units() -> None:
    c = coefficients_for(V32, H800)
    p = derive_scheduler_params(V32, H800, c)
    assert p.beta_tokens == pytest.approx(5 * prefill_tokens_per_s(V32, H800, 32721, 429, c))
    miss = derive_scheduler_params(V32, H800, c, pe_tok_charge=TokCharge.MISS)
    assert miss.beta_tokens == pytest.approx(p.beta_tokens * 429 / (32721 + 429))


def test_sequence_cap_comes_from_the_cost_coefficients_unless_overridden() -> None:
    from dataclasses import replace

    c = replace(coefficients_for(V32, H800), max_seqs_per_decode_engine=18)
    assert derive_scheduler_params(V32, H800, c).max_seqs_per_decode_engine == 18
    free = derive_scheduler_params(V32, H800, c, max_seqs_per_decode_engine=0)
    assert free.max_seqs_per_decode_engine == 0 and not free.is_de_full(10**6)
    capped = derive_scheduler_params(V32, H800, c)
    assert capped.free_de_slots([3, 20, 10]) == 15 + 0 + 8
    assert free.free_de_slots([3, 20, 10]) is None


def test_overrides_win_and_bad_values_name_the_field() -> None:
    p = derive_scheduler_params(V32, H800, alpha_tokens=7, beta_tokens=8, z_factor=1.2)
    assert (p.alpha_tokens, p.beta_tokens, p.z_factor) == (7, 8, 1.2)
    with pytest.raises(SpecError, match=r"scheduler\.z_factor=0"):
        derive_scheduler_params(V32, H800, z_factor=0)
    # Enum fields take their values as strings; anything else names the field.
    assert derive_scheduler_params(V32, H800, path_mode="split").path_mode is PathMode.SPLIT
    with pytest.raises(SpecError, match=r"scheduler\.path_mode='both'.*one of pe, dual, split"):
        derive_scheduler_params(V32, H800, path_mode="both")
    with pytest.raises(SpecError, match=r"scheduler\.z_factor='big'.*number"):
        derive_scheduler_params(V32, H800, z_factor="big")
    with pytest.raises(SpecError, match=r"scheduler\.r_set_stops_at_first_misfit=1"):
        derive_scheduler_params(V32, H800).with_overrides(r_set_stops_at_first_misfit=1)
    with pytest.raises(SpecError, match=r"scheduler\.zz=1.*unknown field"):
        derive_scheduler_params(V32, H800, zz=1)
