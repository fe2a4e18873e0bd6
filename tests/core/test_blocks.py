import pytest

from dualpath.core.blocks import (
    ROOT_KEY,
    KeyScope,
    MediaSpan,
    aligned_hit_tokens,
    block_key,
    block_keys,
    full_blocks,
    hit_blocks,
    longest_prefix,
    max_hit_blocks,
)
from dualpath.core.errors import SpecError


def test_keys_are_prefix_chained() -> None:
    a = list(range(200))
    b = list(range(128)) + [999] * 72
    ka, kb = block_keys(a, 64), block_keys(b, 64)
    assert len(ka) == 3 and len(kb) == 3  # trailing partial block has no key
    assert ka[:2] == kb[:2] and ka[2] != kb[2]
    assert ka[0] == block_key(ROOT_KEY, a[:64])
    assert ka[1] == block_key(ka[0], a[64:128])


def test_same_block_under_a_different_prefix_gets_a_different_key() -> None:
    x = [1] * 64
    k1 = block_keys(x + x, 64)
    assert k1[0] != k1[1]


def test_continuing_from_a_parent_equals_hashing_the_whole() -> None:
    t = list(range(300))
    whole = block_keys(t, 64)
    tail = block_keys(t[128:], 64, parent=whole[1])
    assert whole[2:] == tail


def test_hits_and_prefix_walk() -> None:
    assert aligned_hit_tokens(130, 64) == 128
    assert full_blocks(63, 64) == 0
    stored = set(block_keys(list(range(256)), 64)[:2])
    assert longest_prefix(block_keys(list(range(256)), 64), stored.__contains__) == 2


def test_bad_block_size() -> None:
    with pytest.raises(SpecError, match="block_size"):
        block_keys([1, 2, 3], 0)


def test_the_hit_rule_leaves_the_last_token_to_compute() -> None:
    assert [max_hit_blocks(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]
    tokens = list(range(12))  # an exact multiple: 3 full blocks, 2 may hit
    keys = block_keys(tokens, 4)
    every = set(keys).__contains__
    assert hit_blocks(keys, len(tokens), every, 4) == 2
    assert hit_blocks(keys, len(tokens) + 1, every, 4) == 3
    assert hit_blocks(keys, len(tokens), set(keys[1:]).__contains__, 4) == 0
    # Blocks below `first` are the caller's own (vLLM's prefix cache): the run goes on from it.
    assert hit_blocks(keys, len(tokens) + 1, set(keys[1:]).__contains__, 4, first=1) == 3
    assert hit_blocks(keys, len(tokens) + 1, set().__contains__, 4, first=2) == 2
    with pytest.raises(ValueError, match="2 block keys"):
        hit_blocks(keys[:2], len(tokens) + 1, every, 4)


def test_requests_that_differ_only_in_salt_adapter_or_media_share_no_key() -> None:
    tokens = list(range(256))
    ns = b"n" * 16
    scopes = [KeyScope(), KeyScope(cache_salt="a"), KeyScope(cache_salt="b"),
              KeyScope(adapter=("x", "/lora/x")), KeyScope(adapter=("x", "/lora/x2")),
              KeyScope(adapter=("y", "/lora/x")),
              KeyScope(cache_salt="a", adapter=("x", "/lora/x")),
              KeyScope(media=(MediaSpan("img1", 70, 20),)),
              KeyScope(media=(MediaSpan("img2", 70, 20),)),
              KeyScope(media=(MediaSpan("img1", 72, 20),))]
    chains = [block_keys(tokens, 64, ns, s) for s in scopes]
    seen: set[bytes] = set()
    for i, keys in enumerate(chains):
        if i >= 7:  # media only changes the blocks from the one holding it on
            assert keys[0] == chains[0][0]
            keys = keys[1:]
        assert not seen & set(keys), scopes[i]
        seen |= set(keys)


def test_the_empty_scope_keys_as_before_and_the_same_scope_alike() -> None:
    tokens = list(range(200))
    assert block_keys(tokens, 64, b"n" * 16, KeyScope()) == block_keys(tokens, 64, b"n" * 16)
    salted = KeyScope(cache_salt="t", media=(MediaSpan("i", 10, 5),))
    assert block_keys(tokens, 64, b"n" * 16, salted) == block_keys(
        tokens, 64, b"n" * 16, KeyScope(cache_salt="t", media=(MediaSpan("i", 10, 5),)))
