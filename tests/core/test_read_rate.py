"""The storage read model: its three forms, validation, and the per-hardware record."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from dualpath.core.errors import DualPathError
from dualpath.core.read_rate import (
    NOMINAL,
    THREEFS_PEAK_FRACTION,
    THREEFS_READS_IN_FLIGHT,
    StorageFileError,
    StorageReadModel,
    StorageSpecError,
    parse_storage_read,
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


def test_queued_form_gives_back_the_3fs_measurements_it_was_derived_from() -> None:
    # 3FS#410: 32 reads in flight on one 400 Gb/s NIC, 1 MiB -> 23.2 GiB/s, 4 MiB -> 32.5.
    m = StorageReadModel(reads_in_flight=32)
    assert m.form == "queued" and not m.is_nominal
    assert m.read_bytes_per_s(R, 1 << 20) == pytest.approx(23.2 * 2**30)
    assert m.read_bytes_per_s(R, 4 << 20) == pytest.approx(32.5 * 2**30)
    assert m.read_latency_s == pytest.approx(0.514e-3, rel=1e-3)
    # A deeper queue reaches the cap (3FS#410 after tuning: ~42 GiB/s, 0.9 of the line).
    deep = StorageReadModel(reads_in_flight=128)
    assert deep.read_bytes_per_s(R, 1 << 20) == pytest.approx(THREEFS_PEAK_FRACTION * R)
    # Larger blocks read faster at the same depth: DS 27B < DS 660B < Qwen2.5-32B blocks.
    rates = [m.read_bytes_per_s(R, b) for b in (1.39e6, 3.08e6, 16.8e6)]
    assert rates == sorted(rates) and rates[0] < rates[-1] < THREEFS_PEAK_FRACTION * R


def test_forms_are_named() -> None:
    assert NOMINAL.form == "flat" and StorageReadModel(0.5).form == "flat"
    assert StorageReadModel(per_block_overhead_s=1e-5).form == "per_block"


@pytest.mark.parametrize("kwargs", [{"read_efficiency": 0.0}, {"read_efficiency": 1.2},
                                    {"read_efficiency": float("nan")},
                                    {"per_block_overhead_s": -1e-6},
                                    {"reads_in_flight": -1.0}, {"peak_fraction": 1.5},
                                    {"stream_bytes_per_s": 0.0}])
def test_bad_values_are_refused_by_name(kwargs: dict[str, Any]) -> None:
    with pytest.raises(DualPathError, match=next(iter(kwargs))):
        StorageReadModel(**kwargs)


def test_queued_form_takes_no_flat_or_per_block_numbers() -> None:
    with pytest.raises(DualPathError, match="reads_in_flight=8.0: the queued form"):
        StorageReadModel(read_efficiency=0.5, reads_in_flight=8.0)


def test_record_round_trip_and_derived_presets_keep_their_base(tmp_path: Path) -> None:
    path = tmp_path / "storage.json"
    path.write_text(json.dumps({"entries": []}))
    assert storage_read_model("h800-deepseek", path) is NOMINAL
    write_storage_record("h800-deepseek", StorageReadModel(0.6, source="test fit"),
                         {"form": "flat"}, path)
    m = storage_read_model("h800-deepseek", path)
    assert (m.read_efficiency, m.source) == (0.6, "test fit")
    # `simulate --storage-nic-gb-per-s` and the Qwen setup's buffer rename the preset.
    assert storage_read_model("h800-deepseek+buffer320GB", path) == m
    assert storage_read_model("dgx-h100", path) is NOMINAL
    write_storage_record("h800-deepseek", StorageReadModel(0.7), {}, path)
    assert len(json.loads(path.read_text())["entries"]) == 1  # replaced, not appended
    queued = StorageReadModel(reads_in_flight=31.34, source="queued fit")
    write_storage_record("h800-deepseek", queued, {"form": "queued"}, path)
    back = storage_read_model("h800-deepseek", path)
    assert back.form == "queued" and back.reads_in_flight == 31.34
    assert back.read_bytes_per_s(R, 3.08e6) == pytest.approx(
        queued.read_bytes_per_s(R, 3.08e6), rel=1e-3)


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


def test_storage_read_names_parse_to_their_models() -> None:
    assert parse_storage_read("calibrated") is None
    assert parse_storage_read("nominal") == NOMINAL
    flat = parse_storage_read("flat:0.6")
    assert flat is not None and flat.read_bytes_per_s(1e9, 1e6) == pytest.approx(0.6e9)
    queued = parse_storage_read("queued")
    assert queued is not None and queued.form == "queued"
    assert queued.reads_in_flight == THREEFS_READS_IN_FLIGHT == 32
    # The default depth is 3FS#410's own, so it gives back that benchmark's 1 MiB point.
    assert queued.read_bytes_per_s(50e9, float(1 << 20)) == pytest.approx(
        23.2 * (1 << 30), rel=1e-6)
    named = parse_storage_read(" Queued:20 ")
    assert named is not None and named.reads_in_flight == 20


@pytest.mark.parametrize("text", ["", "flat", "flat:x", "flat:0", "flat:1.5", "queued:0",
                                  "queued:-2", "queued:nan", "queued:inf", "nominal:1", "fast"])
def test_bad_storage_read_names_quote_the_value(text: str) -> None:
    with pytest.raises(StorageSpecError, match=re.escape(f"--storage-read {text!r}")):
        parse_storage_read(text)
