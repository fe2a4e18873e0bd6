"""The pushed blocks' digests (`connector.digest`): the GPU kind (a word sum computed where the
pages are) is checked here on host tensors, the same arithmetic (DUALPATH_TEST_DEVICE=cuda runs
it on a GPU too); the decode side checks either kind against a slot's bytes."""

from __future__ import annotations

import os

import pytest
import torch

from dualpath.integrations.vllm.connector.digest import SUM_TAG, block_digests, matches

KV_DEVICE = torch.device(os.environ.get("DUALPATH_TEST_DEVICE", "cpu"))  # conftest.py
LAYERS, BLOCKS, HEADS, TOKENS, CH = 4, 6, 2, 16, 64


def paged(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, HEADS, TOKENS, CH, generator=g).to(torch.bfloat16).to(KV_DEVICE)
            for _ in range(LAYERS)]


def as_pushed(layers: list[torch.Tensor], block_id: int) -> torch.Tensor:
    """The Full Block as a slot holds it: its pages in layer order."""
    return torch.cat([layer[block_id].cpu().contiguous().reshape(-1).view(torch.uint8)
                      for layer in layers])


@pytest.mark.parametrize("word_sum", [False, True])
def test_a_pushed_blocks_digest_matches_its_slot_bytes_and_nothing_else(word_sum: bool) -> None:
    layers = paged(0)
    digests = block_digests(layers, [4, 1], word_sum=word_sum)
    assert all((d >= SUM_TAG) == word_sum for d in digests)
    assert word_sum or all(d < 1 << 32 for d in digests)
    for block_id, digest in zip((4, 1), digests, strict=True):
        block = as_pushed(layers, block_id)
        assert matches(block, digest)
        flipped = block.clone()
        flipped[len(block) // 2 + 3] ^= 0x01  # one bit of layer 2's page
        assert not matches(flipped, digest)
        swapped = block.clone()  # two 16-bit words exchanged: same words, other places
        swapped[0:2], swapped[2:4] = block[2:4].clone(), block[0:2].clone()
        assert torch.equal(swapped, block) or not matches(swapped, digest)
        assert not matches(as_pushed(layers, 0), digest)  # a stale slot: another block


def test_the_word_sum_is_exact_at_a_70b_blocks_size() -> None:
    """A 128-token block of a 70B rank (64 layers x 512 KiB pages, 32 MiB) of all-ones words:
    the largest sum the weights allow, computed without overflow (a closed form checks it)."""
    layers = [torch.full((1, 8, 128, 256), -1, dtype=torch.int16, device=KV_DEVICE)
              for _ in range(64)]  # 0xFFFF words
    (digest,) = block_digests(layers, [0], word_sum=True)
    n = 64 * 8 * 128 * 256
    full, rest = divmod(n, 65521)
    expected = 0xFFFF * (full * 65521 * 65522 // 2 + rest * (rest + 1) // 2)
    assert digest == expected | SUM_TAG and expected < SUM_TAG
