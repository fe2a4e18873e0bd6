"""`--storage-read` in the experiments: online runs (the advisor's) read storage as asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath.core.storage import NOMINAL, parse_storage_read
from dualpath.experiments.extensions import storage_words
from dualpath.experiments.online import point_spec
from dualpath.experiments.report import Context
from dualpath.experiments.runner import run_storage, storage_fraction
from dualpath.experiments.storage_fit import packaged_model


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
