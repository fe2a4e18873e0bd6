"""`--storage-read` in the planner: online runs (the advisor's) read storage as asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath.core.read_rate import NOMINAL, parse_storage_read
from dualpath.plan.advise import storage_words
from dualpath.plan.capacity import point_spec
from dualpath.plan.runner import block_bytes, run_storage, storage_fraction
from dualpath.plan.section import Context
from dualpath.plan.storage_note import block_size_note
from dualpath.reproduce.storage_fit import packaged_model


def test_queued_reads_each_setup_at_its_own_block_rate() -> None:
    queued = parse_storage_read("queued")
    assert queued is not None
    ds27, ds660, qwen = (storage_fraction(queued, s)
                         for s in ("ds27b_1p1d", "ds660b_2p4d", "qwen32b_1p2d"))
    assert ds27 == pytest.approx(0.550, abs=0.001)
    assert ds27 < ds660 < qwen < 0.9  # larger Full Blocks, faster; under the cap
    flat = packaged_model()
    assert storage_fraction(flat, "ds27b_1p1d") == storage_fraction(flat, "qwen32b_1p2d")
    assert run_storage(NOMINAL, "qwen32b_1p2d") == (1.0, 0.0)


def test_online_points_carry_the_chosen_read_model(tmp_path: Path) -> None:
    plain = Context(tmp_path, is_quick=True)
    assert point_spec(plain, "qwen32b_1p2d", "basic", 0.1).storage is None
    queued = parse_storage_read("queued:16")
    assert queued is not None
    ctx = Context(tmp_path, is_quick=True, storage_read=queued)
    spec = point_spec(ctx, "qwen32b_1p2d", "basic", 0.1)
    assert spec.storage == run_storage(queued, "qwen32b_1p2d")
    assert spec.config().params.storage_read is not None
    assert "queued: 16.0 reads in flight" in storage_words(ctx, "qwen32b_1p2d")
    assert "calibrated record" in storage_words(plain, "qwen32b_1p2d")


def test_calibrated_rate_far_from_its_block_size_says_so(tmp_path: Path) -> None:
    # The flat record was fitted on DS 27B's Full Blocks: runs with blocks far from that size
    # (Qwen's are 12x) are told what the queued form and the paper's other models say.
    nominal = 50e9
    assert block_size_note(block_bytes("ds27b_1p1d"), nominal) == ""
    assert block_size_note(block_bytes("ds27b_1p1d") * 1.9, nominal) == ""
    note = block_size_note(block_bytes("qwen32b_1p2d"), nominal)
    queued = parse_storage_read("queued")
    assert queued is not None
    assert f"{storage_fraction(queued, 'qwen32b_1p2d'):.3f} of the line rate" in note
    assert "12.1x" in note and "about 0.75" in note
    assert block_size_note(block_bytes("qwen32b_1p2d"), nominal, "dgx-h100") == ""  # nominal
    plain = Context(tmp_path, is_quick=True)
    assert "Note: the calibrated rate" in storage_words(plain, "qwen32b_1p2d")
    assert "Note:" not in storage_words(plain, "ds27b_1p1d")
    # DeepSeek-V3.2's blocks are 2.2x the fitted ones, but the paper's own Basic read them at
    # the flat rate: no note.
    assert block_size_note(block_bytes("ds660b_2p4d"), nominal) == ""
    assert block_size_note(block_bytes("ds660b_2p4d") * 1.5, nominal) != ""
