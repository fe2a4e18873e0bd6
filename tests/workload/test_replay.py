import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.core.errors import SpecError
from dualpath.workload.replay import expand_agents, scale_lengths, truncate_at
from dualpath.workload.trajectory import Trajectory

lengths = st.lists(st.integers(1, 3000), min_size=1, max_size=25)


@st.composite
def trajectories(draw: st.DrawFn) -> Trajectory:
    a = draw(lengths)
    g = draw(st.lists(st.integers(1, 800), min_size=len(a), max_size=len(a)))
    return Trajectory(tuple(a), tuple(g), "t")


def test_truncate_examples() -> None:
    t = Trajectory((100, 50, 70), (10, 20, 30), "x")
    assert truncate_at(t, 1000) is t
    # Turn 2 has context 180: 180 + 70 + 1 > 200, so it goes; turn 1 fits fully (total 180).
    assert truncate_at(t, 200) == Trajectory((100, 50), (10, 20), "x")
    # The last kept turn's generation is clipped to reach exactly the MAL.
    assert truncate_at(t, 175) == Trajectory((100, 50), (10, 15), "x")
    # A first turn that does not fit is clipped so the agent keeps one turn.
    assert truncate_at(t, 100) == Trajectory((99,), (1,), "x")
    with pytest.raises(SpecError, match="max_len_tokens"):
        truncate_at(t, 1)


@settings(max_examples=100, deadline=None)
@given(trajectories(), st.integers(2, 40000))
def test_truncate_properties(t: Trajectory, mal: int) -> None:
    cut = truncate_at(t, mal)
    assert cut.total_tokens <= mal
    assert truncate_at(cut, mal) == cut
    if t.append_tokens[0] + 1 <= mal:
        # A prefix of the original turns, only the last generation possibly shorter.
        n = cut.num_turns
        assert cut.append_tokens == t.append_tokens[:n]
        assert cut.gen_tokens[:-1] == t.gen_tokens[: n - 1]
        assert 1 <= cut.gen_tokens[-1] <= t.gen_tokens[n - 1]
        if n < t.num_turns:  # the next turn really did not fit
            assert cut.total_tokens - cut.gen_tokens[-1] + t.gen_tokens[n - 1] \
                + t.append_tokens[n] + 1 > mal


def test_scale_then_truncate() -> None:
    t = Trajectory((100, 3, 70), (10, 1, 30), "x")
    s = scale_lengths(t, append_factor=2.0)
    assert s.append_tokens == (200, 6, 140) and s.gen_tokens == t.gen_tokens
    g = scale_lengths(t, gen_factor=0.1)
    assert g.gen_tokens == (1, 1, 3)  # rounded, at least one token
    assert scale_lengths(t, 2.0, 1.0, max_len_tokens=250) == truncate_at(s, 250)
    with pytest.raises(SpecError, match="append_factor"):
        scale_lengths(t, 0.0)


def test_expand_agents() -> None:
    trajs = [Trajectory((100 + k,), (10,), f"t{k}") for k in range(3)]
    agents = expand_agents(trajs, 10, seed=7)
    assert [a.agent_index for a in agents] == list(range(10))
    assert [a.trajectory for a in agents[:3]] == trajs
    assert not any(a.has_synthetic_round for a in agents[:3])
    for a in agents[3:]:
        src = trajs[a.source_index]
        assert a.has_synthetic_round
        assert a.trajectory.append_tokens == (64, *src.append_tokens)
        assert a.trajectory.gen_tokens == (1, *src.gen_tokens)
    assert expand_agents(trajs, 10, seed=7) == agents
    assert {a.source_index for a in expand_agents(trajs, 200, seed=1)[3:]} == {0, 1, 2}
    assert len(expand_agents(trajs, 2)) == 2
    with pytest.raises(SpecError):
        expand_agents([], 3)
