"""Prefix-chained block keys: `key_i = H(key_{i-1}, tokens of block i)`, and the stored-prefix
hit rule every real world applies (the runtime's driver, the vLLM router and connector).

A block covers `block_size` tokens. Only full blocks get keys (a trailing partial block is not
stored), so the longest cached prefix of a prompt is a walk over its keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence

from dualpath.core.errors import SpecError

DEFAULT_BLOCK_SIZE = 64
KEY_BYTES = 16
ROOT_KEY = bytes(KEY_BYTES)


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Key of one full block given its parent's key (ROOT_KEY for the first block)."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in tokens))
    return h.digest()


def block_keys(
    tokens: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE, parent: bytes = ROOT_KEY
) -> list[bytes]:
    """Keys of every full block of `tokens` (a trailing partial block gets none)."""
    if block_size < 1:
        raise SpecError("blocks", "block_size", block_size, "must be an integer >= 1")
    keys: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[start : start + block_size])
        keys.append(parent)
    return keys


def full_blocks(num_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Number of full blocks in `num_tokens` tokens."""
    return num_tokens // block_size


def aligned_hit_tokens(context_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Block-aligned hit of a context fully stored before: floor(context / bs) * bs."""
    return (context_tokens // block_size) * block_size


def longest_prefix(keys: Iterable[bytes], is_stored: Callable[[bytes], bool]) -> int:
    """Number of leading keys for which `is_stored` holds (the hit length in blocks)."""
    n = 0
    for key in keys:
        if not is_stored(key):
            break
        n += 1
    return n


def max_hit_blocks(num_prompt_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The most full blocks a prompt may take from storage: its last token is always computed
    (the prefill samples the first output token from its logits)."""
    return max(num_prompt_tokens - 1, 0) // block_size


def hit_blocks(
    keys: Sequence[bytes],
    num_prompt_tokens: int,
    is_stored: Callable[[bytes], bool],
    block_size: int = DEFAULT_BLOCK_SIZE,
    first: int = 0,
    blocks_per_file: int = 1,
) -> int:
    """A prompt's hit in blocks: blocks `[0, n)` are taken from storage (or, below `first`, the
    caller has them already, as vLLM's own prefix cache does), `n` the end of the run of
    stored keys from `first` on, at most `max_hit_blocks`. `keys` are the prompt's block keys
    (`block_keys`, from any parent), at least `max_hit_blocks` of them.

    `blocks_per_file` (g): a stored file holds g aligned blocks, `[i * g, (i + 1) * g)`, under
    its last block's key, whole or not at all, so a hit counts whole files: `n` is a multiple
    of g (at most `max_hit_blocks(num_prompt_tokens, g * block_size)` files), or `first` when
    the file holding block `first` is not stored. g = 1 is the rule above, block by block."""
    g = blocks_per_file
    if g < 1:
        raise SpecError("blocks", "blocks_per_file", g, "must be an integer >= 1")
    limit = max_hit_blocks(num_prompt_tokens, block_size * g)
    if len(keys) < limit * g:
        raise ValueError(f"{len(keys)} block keys for a prompt that may hit {limit * g} blocks")
    n = first // g
    while n < limit and is_stored(keys[n * g + g - 1]):
        n += 1
    return max(n * g, first)
