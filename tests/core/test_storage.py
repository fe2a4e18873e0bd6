"""The storage read model: its two forms, validation, and the per-hardware record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.core.errors import DualPathError
from dualpath.core.storage import (
    NOMINAL,
    StorageFileError,
    StorageReadModel,
    storage_read_model,
    write_storage_record,
)

R = 50e9  # 400 Gb/s


def test_flat_form_is_the_same_fraction_for_every_block_size() -> None:
    m = StorageReadModel(read_efficiency=0.5)
    for block in (1.39e6, 3.08e6, 16.8e6):
        assert m.read_bytes_per_s(R, block) == pytest.approx(0.5 * R)
    assert NOMINAL.read_bytes_per_s(R, 1e6) == R and NOMINAL.is_nominal


def test_per_block_form_favours_large_blocks() -> None:
    # 28 us of bytes plus 28 us of overhead: half the line rate for a 1.4 MB block.
    m = StorageReadModel(per_block_overhead_s=1.4e6 / R)
    assert m.read_bytes_per_s(R, 1.4e6) == pytest.approx(0.5 * R)
    big = m.read_bytes_per_s(R, 16.8e6)
    assert big == pytest.approx(R * 12 / 13)
    assert not m.is_nominal


@pytest.mark.parametrize("kwargs", [{"read_efficiency": 0.0}, {"read_efficiency": 1.2},
                                    {"read_efficiency": float("nan")},
                                    {"per_block_overhead_s": -1e-6}])
def test_bad_values_are_refused_by_name(kwargs: dict[str, float]) -> None:
    with pytest.raises(DualPathError, match=next(iter(kwargs))):
        StorageReadModel(**kwargs)


def test_record_round_trip_and_derived_presets_keep_their_base(tmp_path: Path) -> None:
    path = tmp_path / "storage.json"
    path.write_text(json.dumps({"entries": []}))
    assert storage_read_model("h800-deepseek", path) is NOMINAL
    write_storage_record("h800-deepseek", StorageReadModel(0.6, 0.0, "test fit"),
                         {"form": "flat"}, path)
    m = storage_read_model("h800-deepseek", path)
    assert (m.read_efficiency, m.source) == (0.6, "test fit")
    # `simulate --storage-nic-gbps` and the Qwen setup's buffer rename the preset.
    assert storage_read_model("h800-deepseek+buffer320GB", path) == m
    assert storage_read_model("dgx-h100", path) is NOMINAL
    write_storage_record("h800-deepseek", StorageReadModel(0.7), {}, path)
    assert len(json.loads(path.read_text())["entries"]) == 1  # replaced, not appended


def test_malformed_record_names_the_file_and_entry(tmp_path: Path) -> None:
    path = tmp_path / "storage.json"
    path.write_text(json.dumps({"entries": [{"hardware": "h800-deepseek",
                                             "read_efficiency": "fast"}]}))
    with pytest.raises(StorageFileError, match=r"storage.json: entry 0 .*read_efficiency='fast'"):
        storage_read_model("h800-deepseek", path)
    path.write_text(json.dumps({"entries": [{"hardware": "h800-deepseek",
                                             "per_block_overhead_s": True}]}))
    with pytest.raises(StorageFileError, match="per_block_overhead_s=True: must be a number"):
        storage_read_model("h800-deepseek", path)
    path.write_text("{not json")
    with pytest.raises(StorageFileError, match=r"storage.json:1: invalid JSON"):
        storage_read_model("h800-deepseek", path)
