import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.core.errors import SpecError
from dualpath.workload.trajectory import Trajectory, TurnTable

lengths = st.lists(st.integers(1, 5000), min_size=1, max_size=30)


@st.composite
def trajectories(draw: st.DrawFn) -> Trajectory:
    a = draw(lengths)
    g = draw(st.lists(st.integers(1, 2000), min_size=len(a), max_size=len(a)))
    return Trajectory(tuple(a), tuple(g), draw(st.text(max_size=5)))


def test_derived_lengths_follow_the_replay_model() -> None:
    t = Trajectory((100, 50, 70), (10, 20, 30), "x")
    assert t.num_turns == 3
    assert t.total_tokens == 280
    assert t.context_tokens().tolist() == [0, 110, 180]
    assert t.prompt_tokens().tolist() == [100, 160, 250]
    assert t.hit_tokens().tolist() == [0, 64, 128]
    assert t.hit_tokens(block_size=16).tolist() == [0, 96, 176]
    turn = t.turns()[2]
    assert (turn.turn_index, turn.context_tokens, turn.prompt_tokens, turn.hit_tokens) == (
        2, 180, 250, 128)
    assert turn.miss_tokens == 122


@pytest.mark.parametrize(
    ("append", "gen", "field"),
    [
        ((), (), "append_tokens"),
        ((1, 2), (1,), "gen_tokens"),
        ((1, 0), (1, 1), "append_tokens[1]"),
        ((1, 1), (1, -3), "gen_tokens[1]"),
        ((1, True), (1, 1), "append_tokens[1]"),
    ],
)
def test_invalid_lengths_name_the_field(append: tuple[int, ...], gen: tuple[int, ...],
                                        field: str) -> None:
    with pytest.raises(SpecError) as info:
        Trajectory(append, gen, "bad")
    assert info.value.field == field


def test_bad_block_size() -> None:
    with pytest.raises(SpecError, match="block_size"):
        Trajectory((1,), (1,)).hit_tokens(0)


@settings(max_examples=60, deadline=None)
@given(st.lists(trajectories(), min_size=1, max_size=6), st.sampled_from([1, 16, 64, 512]))
def test_turn_table_matches_per_trajectory_values(trajs: list[Trajectory], bs: int) -> None:
    table = TurnTable.from_trajectories(trajs, bs)
    assert table.num_trajectories == len(trajs)
    assert table.num_turns == sum(t.num_turns for t in trajs)
    assert np.array_equal(table.context_tokens,
                          np.concatenate([t.context_tokens() for t in trajs]))
    assert np.array_equal(table.hit_tokens, np.concatenate([t.hit_tokens(bs) for t in trajs]))
    assert np.array_equal(table.prompt_tokens,
                          np.concatenate([t.prompt_tokens() for t in trajs]))
    assert table.total_tokens.tolist() == [t.total_tokens for t in trajs]
    for k, t in enumerate(trajs):
        lo, hi = table.starts[k], table.starts[k + 1]
        assert (table.trajectory_index[lo:hi] == k).all()
        assert table.turn_index[lo:hi].tolist() == list(range(t.num_turns))
        assert table.trajectory(k, t.trajectory_id) == t
    # Hits are block aligned, never exceed the context, and lose less than one block.
    assert (table.hit_tokens % bs == 0).all()
    assert (table.hit_tokens <= table.context_tokens).all()
    assert (table.context_tokens - table.hit_tokens < bs).all()
