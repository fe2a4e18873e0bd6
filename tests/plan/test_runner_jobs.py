"""`--jobs`: independent runs in several processes give exactly the serial results."""

from __future__ import annotations

from pathlib import Path

from dualpath.plan.capacity import capacities
from dualpath.plan.runner import Runner, RunSpec
from dualpath.plan.section import Context


def test_prefetch_in_processes_equals_serial_runs() -> None:
    specs = [RunSpec("ds27b_1p1d", m, n, "32k") for m in ("basic", "dualpath") for n in (3, 5)]
    serial, parallel = Runner(), Runner(jobs=2)
    parallel.prefetch(specs)
    assert len(parallel.log) == len(specs)
    for s in specs:
        a, b = serial.run(s), parallel.run(s)
        assert (a.jct_s, a.num_completed) == (b.jct_s, b.num_completed)
        assert (a.ttft_s == b.ttft_s).all()
    assert len(parallel.log) == len(specs)  # served from the cache afterwards


def test_capacity_searches_in_processes_equal_serial(tmp_path: Path) -> None:
    tasks = [("ds27b_1p1d", m, 0, None) for m in ("basic", "dualpath")]
    ctx = Context(tmp_path, online_duration_s=20.0)
    serial = capacities(ctx, tasks)
    parallel = Context(tmp_path, Runner(jobs=2), online_duration_s=20.0)
    assert repr(capacities(parallel, tasks)) == repr(serial)  # repr: NaN fields compare equal
    # Every run a worker made is the parent's too, as in a serial run.
    assert set(parallel.runner.cache) == set(ctx.runner.cache)
    assert len(parallel.runner.log) == len(ctx.runner.log)
