import pytest

from dualpath.core.blocks import block_keys
from dualpath.core.errors import SpecError
from dualpath.workload.tokens import RandomTokens, TextTokens, prompt_ids
from dualpath.workload.trajectory import Trajectory


def test_random_tokens_are_deterministic_and_in_range() -> None:
    src = RandomTokens(vocab_size=1000, seed=3, min_token_id=10)
    ids = src.append_ids(2, 5, 500)
    assert len(ids) == 500 and all(10 <= t < 1000 for t in ids)
    assert RandomTokens(1000, 3, 10).append_ids(2, 5, 500) == ids  # another instance, same ids
    assert src.append_ids(2, 6, 500) != ids
    assert src.append_ids(3, 5, 500) != ids
    assert RandomTokens(1000, 4, 10).append_ids(2, 5, 500) != ids
    assert src.append_ids(0, 0, 0) == []
    with pytest.raises(SpecError, match="min_token_id"):
        RandomTokens(10, 0, 10)


def test_prompts_extend_each_other_so_block_keys_are_prefixes() -> None:
    t = Trajectory((150, 40, 90), (30, 20, 10), "a")
    src = RandomTokens(32000, seed=1)
    generated = [list(range(100, 130)), list(range(200, 220))]
    prompts = [prompt_ids(src, 7, t, i, generated) for i in range(3)]
    assert [len(p) for p in prompts] == t.prompt_tokens().tolist()
    for i in range(2):
        nxt = prompts[i + 1]
        assert nxt[: len(prompts[i])] == prompts[i]
        assert nxt[len(prompts[i]) : len(prompts[i]) + t.gen_tokens[i]] == generated[i]
        k0, k1 = block_keys(prompts[i], 16), block_keys(nxt, 16)
        assert k1[: len(k0)] == k0
        # The hit the trajectory model predicts is exactly the shared full blocks of the context.
        ctx = int(t.context_tokens()[i + 1])
        assert len(block_keys(nxt[:ctx], 16)) * 16 == int(t.hit_tokens(16)[i + 1])
    # Another agent replaying the same trajectory shares no block.
    other = prompt_ids(src, 8, t, 2, generated)
    assert not set(block_keys(other, 16)) & set(block_keys(prompts[2], 16))


def test_prompt_ids_checks_generated_lengths() -> None:
    t = Trajectory((5, 5), (3, 3))
    src = RandomTokens(100)
    with pytest.raises(SpecError, match=r"generated\[0\]"):
        prompt_ids(src, 0, t, 1, [[1, 2]])
    with pytest.raises(SpecError, match="turn_index"):
        prompt_ids(src, 0, t, 2, [[1, 2, 3], [1, 2, 3]])
    with pytest.raises(SpecError, match="generated"):
        prompt_ids(src, 0, t, 1, [])


def test_text_tokens_fit_the_requested_length() -> None:
    def encode(s: str) -> list[int]:
        return [ord(c) for c in s]

    src = TextTokens({(0, 0): "abc"}, encode, RandomTokens(50, seed=2))
    assert src.append_ids(0, 0, 7) == [97, 98, 99, 97, 98, 99, 97]
    assert src.append_ids(0, 0, 2) == [97, 98]
    assert src.append_ids(0, 1, 4) == RandomTokens(50, seed=2).append_ids(0, 1, 4)
    with pytest.raises(SpecError, match="no tokens"):
        TextTokens({(0, 0): ""}, encode, RandomTokens(50)).append_ids(0, 0, 3)
