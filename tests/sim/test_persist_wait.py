"""SimParams.is_next_turn_after_persist: an agent's next turn waits for the last one's blocks
to be in storage (what the runtime does), and only then."""

from __future__ import annotations

import numpy as np
import pytest
from sim_cases import BS, run_offline, tiny_cluster, trajectories

from dualpath.sim import SimParams


def test_next_turn_arrives_after_the_persist_of_the_last() -> None:
    cl = tiny_cluster(snic_gbps=0.5)  # slow storage NIC: persistence takes visible time
    wl = trajectories(num_agents=1, num_turns=3, append=4096, gen=2, first=8192)
    free = run_offline(cl, wl, "dualpath")
    waits = run_offline(cl, wl, "dualpath", params=SimParams(is_next_turn_after_persist=True))
    assert waits.num_completed == free.num_completed == 3
    kv = cl.model.kv_bytes_per_token
    # Each turn but the last writes its new Full Blocks before the next one may start: at
    # least their bytes at the storage NIC's write rate more per turn.
    new_tokens = [(8192 + 2) // BS * BS, (8192 + 4096 + 4) // BS * BS - (8192 + 2) // BS * BS]
    at_least = sum(t * kv for t in new_tokens) / cl.hardware.storage_nic_bytes_per_s
    assert waits.jct_s >= free.jct_s + 0.9 * at_least
    assert waits.jct_s == pytest.approx(free.jct_s + at_least, rel=0.5)


def test_oracle_persists_nothing_so_nothing_waits() -> None:
    cl = tiny_cluster(snic_gbps=0.5)
    wl = trajectories(num_agents=2, num_turns=3, append=4096, gen=2, first=8192)
    a = run_offline(cl, wl, "oracle")
    b = run_offline(cl, wl, "oracle", params=SimParams(is_next_turn_after_persist=True))
    assert np.isclose(a.jct_s, b.jct_s)
