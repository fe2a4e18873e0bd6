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


def test_an_engine_view_sums_its_gpus_and_keeps_the_papers_ratios() -> None:
    from dualpath.core.analysis import pd_range

    hw = hardware_preset("h200")
    tp8 = hw.engine_view(8)
    assert hw.engine_view(1) is hw and hw.engine_view(8) is tp8
    assert (tp8.gpus_per_node, tp8.gpus_per_engine) == (1, 8)
    assert tp8.hbm_bytes == 8 * hw.hbm_bytes
    assert tp8.compute_nic_bytes_per_s == 8 * hw.compute_nic_bytes_per_s
    assert tp8.storage_nic_bytes_per_s == hw.storage_nic_bytes_per_s
    assert tp8.nvlink_bytes_per_s == hw.nvlink_bytes_per_s
    # Per engine, s/g and M/(Bs) are the node's: the bottleneck-free range does not move.
    assert pd_range(hw.engine_view(2)) == pytest.approx(pd_range(hw))


@pytest.mark.parametrize(("hw", "tp", "message"), [
    ("h200", 3, "must divide the 8 GPUs"),
    ("h200", 0, "tensor_parallel_size=0"),
    ("cpu-emulated", 2, "nvlink_bytes_per_s=0.0: an engine spanning GPUs"),
])
def test_an_engine_the_node_cannot_form_is_refused(hw: str, tp: int, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        hardware_preset(hw).engine_view(tp)
    with pytest.raises(SpecError, match="already an engine view"):
        hardware_preset("h200").engine_view(2).engine_view(4)
