"""Prefix-chained block keys: `key_i = H(key_{i-1}, tokens of block i)`, and the stored-prefix
hit rule every real world applies (the runtime's driver, the vLLM router and connector).

A block covers `block_size` tokens. Only full blocks get keys (a trailing partial block is not
stored), so the longest cached prefix of a prompt is a walk over its keys.

A block's KV depends on more than its tokens: the model and KV format (the chain's parent, a
namespace), and per request on what vLLM's own block hash covers: the tenant's cache salt, the
LoRA adapter, and the multimodal inputs whose placeholder tokens the block holds. `KeyScope`
carries those, so two requests that differ in any of them never share a key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from dualpath.core.errors import SpecError

DEFAULT_BLOCK_SIZE = 64
KEY_BYTES = 16
ROOT_KEY = bytes(KEY_BYTES)


def block_key(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """Key of one full block given its parent's key (ROOT_KEY for the first block); `extra`:
    what else the block's KV depends on (`KeyScope.block_extra`; empty: nothing)."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in tokens))
    if extra:  # after a fixed-length token run, behind a byte no token run ends the hash on
        h.update(b"\xffextra")
        h.update(extra)
    return h.digest()


@dataclass(frozen=True)
class MediaSpan:
    """A multimodal input in a prompt: the engine's hash of its content (vLLM's
    `mm_feature.identifier`) and the placeholder tokens it occupies."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class KeyScope:
    """What a request's KV depends on besides the model and its token ids, as vLLM's block
    hash sees it: `cache_salt` (a tenant's), the LoRA `adapter` (name, path: a name pointed at
    other weights is another adapter), and the multimodal inputs (`media`). The empty scope
    is a base-model request of no tenant, keyed by its tokens alone."""

    cache_salt: str | None = None
    adapter: tuple[str, str] | None = None
    media: tuple[MediaSpan, ...] = ()

    def namespace(self, parent: bytes) -> bytes:
        """The parent key of this request's chain: `parent` (the model's namespace) itself
        for a request without salt or adapter, else a hash of both."""
        if self.cache_salt is None and self.adapter is None:
            return parent
        h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
        h.update(b"\xffscope")
        h.update(json.dumps([self.cache_salt, self.adapter]).encode())
        return h.digest()

    def block_extra(self, start: int, stop: int) -> bytes:
        """What tokens `[start, stop)` hold besides their ids: each multimodal input they
        overlap, by its hash and its offset from `start` (the same image at another place in
        otherwise equal placeholder tokens is another block)."""
        inside = [(m.identifier, m.offset - start) for m in self.media
                  if m.offset < stop and m.offset + m.length > start]
        return json.dumps(inside).encode() if inside else b""


NO_SCOPE = KeyScope()
"""The empty scope: a base-model request of no tenant."""


def block_keys(
    tokens: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE, parent: bytes = ROOT_KEY,
    scope: KeyScope | None = None,
) -> list[bytes]:
    """Keys of every full block of `tokens` (a trailing partial block gets none), chained
    from `parent` within `scope` (None: the empty scope)."""
    if block_size < 1:
        raise SpecError("blocks", "block_size", block_size, "must be an integer >= 1")
    if scope is not None:
        parent = scope.namespace(parent)
    keys: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        stop = start + block_size
        extra = scope.block_extra(start, stop) if scope is not None and scope.media else b""
        parent = block_key(parent, tokens[start:stop], extra)
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
