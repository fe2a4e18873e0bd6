from fractions import Fraction

import pytest

from dualpath.core.analysis import analyze, pd_range
from dualpath.core.hardware import hardware_preset
from dualpath.core.units import GB


def test_paper_worked_example_range() -> None:
    r = pd_range(hardware_preset("h800-deepseek"))
    assert r.lower == pytest.approx(1 / 7)
    assert r.upper_de_cnic_read == pytest.approx(6.0)
    assert r.upper_de_cnic_write == pytest.approx(3.5)
    assert r.upper_de_dram == pytest.approx(3.5)
    assert r.upper == pytest.approx(3.5)
    assert r.pe_read_ok and r.pe_dram_ok


def test_dgx_h100_range() -> None:
    r = pd_range(hardware_preset("dgx-h100"))
    assert r.lower == pytest.approx(1 / 3)
    assert r.upper == pytest.approx(1.0)
    assert r.upper_binding == "de_dram"


@pytest.mark.parametrize(("p", "d"), [(2, 4), (1, 2), (48, 96), (44, 88), (1, 1), (2, 1)])
def test_paper_configurations_are_inside(p: int, d: int) -> None:
    a = analyze(hardware_preset("h800-deepseek"), p, d)
    assert a.range.contains(a.pd_ratio)
    assert a.is_bottleneck_free
    assert a.storage_read_fraction == 1.0


def test_each_constraint_equals_the_papers_closed_form() -> None:
    hw = hardware_preset("h800-deepseek")
    g, s, b, m = 8.0, 1.0, hw.compute_nic_bytes_per_s, hw.dram_bytes_per_s
    p, d = 3, 5
    a = analyze(hw, p, d)
    u = {c.name: c.utilization for c in a.constraints}
    assert a.t_p_bytes_per_s == pytest.approx(b * s / (d * g * g))
    assert a.t_c_bytes_per_s == pytest.approx(b * s / (p * g * g))
    assert u["pe_cnic_read"] == pytest.approx(2 * s / g)
    assert u["pe_cnic_write"] == pytest.approx((s / g) * (1 + d / p))
    assert u["de_cnic_read"] == pytest.approx((s / g) * (p / d + 2))
    assert u["de_cnic_write"] == pytest.approx((s / g) * (2 * p / d + 1))
    assert u["pe_dram"] == pytest.approx(2 * s * b / m)
    assert u["de_dram"] == pytest.approx((3 + 2 * p / d) * b * s / m)


def test_each_bound_is_where_its_constraint_reaches_one() -> None:
    hw = hardware_preset("h800-deepseek")
    r = pd_range(hw)
    # Lower bound 1/7: P=1, D=7 exactly saturates the PE write direction.
    at_lower = analyze(hw, 1, 7)
    assert {c.name: c for c in at_lower.constraints}["pe_cnic_write"].utilization == pytest.approx(
        1
    )
    below = analyze(hw, 1, 8)
    assert not below.is_bottleneck_free and below.binding.name == "pe_cnic_write"
    # Upper 7/2: P=7, D=2 saturates the DE write direction and DE DRAM together.
    at_upper = analyze(hw, 7, 2)
    u = {c.name: c.utilization for c in at_upper.constraints}
    assert u["de_cnic_write"] == pytest.approx(1) and u["de_dram"] == pytest.approx(1)
    assert Fraction(r.upper).limit_denominator(8) == Fraction(7, 2)


def test_de_cnic_read_bound_binds_when_dram_is_plentiful() -> None:
    hw = hardware_preset("h800-deepseek").with_overrides(
        dram_bytes_per_s=5000 * GB, storage_nic_bytes_per_s=150 * GB
    )
    r = pd_range(hw)  # s = 3, g = 8: (g-2s)/s = 2/3 < (g-s)/(2s) = 5/6
    assert r.upper_binding == "de_cnic_read"
    assert r.upper == pytest.approx(2 / 3)


def test_read_direction_needs_s_at_most_half_g() -> None:
    # s = 5 <= g = 8, which the paper's text accepts, but 2s/g = 1.25 > 1.
    hw = hardware_preset("h800-deepseek").with_overrides(
        storage_nic_bytes_per_s=250 * GB, dram_bytes_per_s=10_000 * GB
    )
    r = pd_range(hw)
    assert not r.pe_read_ok
    assert r.is_empty
    a = analyze(hw, 1, 1)
    assert {c.name: c for c in a.constraints}["pe_cnic_read"].utilization == pytest.approx(1.25)
    assert not a.is_bottleneck_free


def test_outside_range_reports_binding_resource_and_factor() -> None:
    a = analyze(hardware_preset("h800-deepseek"), 8, 1)
    assert not a.range.contains(a.pd_ratio)
    assert a.binding.name == "de_cnic_write"
    assert a.binding.utilization == pytest.approx((1 / 8) * (2 * 8 + 1))
    assert a.storage_read_fraction == pytest.approx(1 / a.binding.utilization)
    # PE-only reading is capped too (all prefill KV still lands in one decode node).
    assert a.basic_read_fraction < 1


def test_dualpath_triples_reads_at_2p4d() -> None:
    a = analyze(hardware_preset("h800-deepseek"), 2, 4)
    assert a.storage_read_bytes_per_s / a.basic_storage_read_bytes_per_s == pytest.approx(3.0)
