import dataclasses

import pytest

from dualpath.core.errors import SpecError, UnknownPresetError
from dualpath.core.hardware import HARDWARE_PRESETS, hardware_preset
from dualpath.core.units import GB, gbit_per_s


@pytest.mark.parametrize("name", sorted(HARDWARE_PRESETS))
def test_every_preset_is_valid_and_has_a_source(name: str) -> None:
    hw = hardware_preset(name)
    assert hw.name == name
    assert hw.source
    assert 0 < hw.storage_nic_ratio <= hw.gpus_per_node
    with pytest.raises(dataclasses.FrozenInstanceError):
        hw.gpus_per_node = 4  # type: ignore[misc]


def test_paper_testbed_numbers() -> None:
    hw = hardware_preset("h800-deepseek")
    assert hw.gpus_per_node == 8
    assert hw.compute_nic_bytes_per_s == gbit_per_s(400) == 50 * GB
    assert hw.storage_nic_ratio == 1.0
    assert hw.dram_bytes_per_s == 500 * GB
    assert hardware_preset("dgx-h100").storage_nic_ratio == 2.0


def test_cpu_emulated_keeps_the_papers_one_eighth_ratio() -> None:
    hw = hardware_preset("cpu-emulated")
    assert hw.storage_nic_bytes_per_s * 8 == pytest.approx(hw.node_compute_nic_bytes_per_s)


def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(UnknownPresetError, match="valid: b200, cpu-emulated"):
        hardware_preset("a100")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("compute_nic_bytes_per_s", 0.0),
        ("compute_nic_bytes_per_s", -1.0),
        ("dram_bytes_per_s", float("nan")),
        ("gpus_per_node", 0),
        ("gpus_per_node", 2.5),
        ("hbm_bytes", -5),
    ],
)
def test_bad_fields_name_field_and_value(field: str, value: object) -> None:
    with pytest.raises(SpecError, match=field) as err:
        hardware_preset("h800-deepseek").with_overrides(**{field: value})
    assert err.value.field == field


def test_storage_faster_than_all_compute_nics_is_rejected() -> None:
    with pytest.raises(SpecError, match="storage_nic_bytes_per_s"):
        hardware_preset("h800-deepseek").with_overrides(storage_nic_bytes_per_s=9 * 50 * GB)
