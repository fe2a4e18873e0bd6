"""SimParams.read_streams_per_request: each request's storage read is also capped at N Full
Block reads in flight, N x S / (L + S / r), under the shared read discipline."""

from __future__ import annotations

import pytest
from sim_cases import read_rate, run_offline, tiny_cluster, trajectories

from dualpath.core.errors import SpecError
from dualpath.core.read_rate import storage_read_model
from dualpath.sim import ReadDiscipline, SimParams, SimResult

CL = tiny_cluster()
SHARED = ReadDiscipline("shared", 0)
BLOCK_BYTES = CL.model.kv_bytes_per_token * 64


def _run(streams: int, mode: str = "basic", num_agents: int = 1) -> SimResult:
    wl = trajectories(num_agents=num_agents, num_turns=2, append=64, gen=4, first=16000)
    params = SimParams(pe_reads=SHARED, de_reads=SHARED, read_streams_per_request=streams)
    return run_offline(CL, wl, mode, params=params)


def _read_seconds(res: SimResult) -> list[float]:
    """How long each turn with hits took from its PE assignment to its read's end."""
    hits, start, end = res.col("hit_tokens"), res.col("pe_assigned_s"), res.col("read_done_s")
    return [float(e - s) for h, s, e in zip(hits, start, end, strict=True) if h > 0]


@pytest.mark.parametrize("streams", [1, 3])
def test_a_lone_read_moves_at_its_streams_rate(streams: int) -> None:
    res = _run(streams)
    hit_bytes = float(res.col("hit_tokens").max()) * CL.model.kv_bytes_per_token
    one_read_s = storage_read_model(CL.hardware.name).read_time_s(BLOCK_BYTES)
    cap = streams * BLOCK_BYTES / one_read_s
    assert cap < read_rate(CL.hardware, CL.model.kv_bytes_per_token)  # the bound binds
    (took,) = _read_seconds(res)
    assert took == pytest.approx(hit_bytes / cap, rel=1e-6)


def test_unbounded_reads_take_the_nics_rate_and_the_bound_only_slows() -> None:
    free, one = _run(0), _run(1)
    hit_bytes = float(free.col("hit_tokens").max()) * CL.model.kv_bytes_per_token
    (took,) = _read_seconds(free)
    assert took == pytest.approx(hit_bytes / read_rate(CL.hardware,
                                                       CL.model.kv_bytes_per_token), rel=1e-6)
    assert _read_seconds(one)[0] > 2 * took
    assert one.jct_s > free.jct_s


def test_many_reads_together_still_share_the_nic() -> None:
    # Enough concurrent requests that their stream caps add up past the NIC: the NIC binds,
    # so the streams bound changes little; one request alone is slowed far more.
    many = [_run(s, num_agents=64) for s in (0, 1)]
    lone = [_run(s) for s in (0, 1)]
    assert many[1].jct_s / many[0].jct_s < 0.5 * (lone[1].jct_s / lone[0].jct_s) + 0.5


def test_fifo_with_a_streams_bound_is_refused() -> None:
    with pytest.raises(SpecError, match="read_streams_per_request"):
        SimParams(read_streams_per_request=1)
    with pytest.raises(SpecError, match="read_streams_per_request"):
        SimParams(pe_reads=SHARED, read_streams_per_request=2)
    with pytest.raises(SpecError, match="read_streams_per_request"):
        SimParams(pe_reads=SHARED, de_reads=SHARED, read_streams_per_request=-1)
