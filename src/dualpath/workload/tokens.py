"""Deterministic token ids for replaying trajectories on a real model.

The runtime needs actual ids for each turn's appended tokens (the generated ones come from the
model). `RandomTokens` draws them from a generator seeded by (seed, agent, turn), so the same
agent's turn always gets the same ids, in any process, in any order of calls; hence the same
prompt prefix always hashes to the same block keys (`core.blocks.block_keys`). `TextTokens` uses
real text per turn instead, encoded by the caller's tokenizer.

A prompt is assembled exactly as the replay model says: the appended ids of turns 0..i and the
generated ids of turns 0..i-1, interleaved (`prompt_ids`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dualpath.core.errors import SpecError
from dualpath.core.validate import non_negative_int, positive_int
from dualpath.workload.trajectory import Trajectory


class TokenSource(Protocol):
    """Where appended token ids come from: `num_tokens` ids for (agent, turn), deterministic."""

    def append_ids(self, agent_index: int, turn_index: int, num_tokens: int) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class RandomTokens:
    """Uniform ids in [min_token_id, vocab_size) seeded by (seed, agent, turn).

    `min_token_id` keeps special tokens (BOS/EOS/pad, usually the lowest ids) out of prompts.
    """

    vocab_size: int
    seed: int = 0
    min_token_id: int = 0

    def __post_init__(self) -> None:
        positive_int("RandomTokens", "vocab_size", self.vocab_size)
        non_negative_int("RandomTokens", "seed", self.seed)
        non_negative_int("RandomTokens", "min_token_id", self.min_token_id)
        if self.min_token_id >= self.vocab_size:
            raise SpecError("RandomTokens", "min_token_id", self.min_token_id,
                            f"must be below vocab_size {self.vocab_size}")

    def append_ids(self, agent_index: int, turn_index: int, num_tokens: int) -> list[int]:
        non_negative_int("RandomTokens", "agent_index", agent_index)
        non_negative_int("RandomTokens", "turn_index", turn_index)
        non_negative_int("RandomTokens", "num_tokens", num_tokens)
        rng = np.random.default_rng(
            np.random.SeedSequence(self.seed, spawn_key=(agent_index, turn_index))
        )
        ids = rng.integers(self.min_token_id, self.vocab_size, size=num_tokens, dtype=np.int64)
        return [int(t) for t in ids]


@dataclass(frozen=True, slots=True)
class TextTokens:
    """Real text per (agent, turn), encoded by `encode` (e.g. a tokenizer's `encode`).

    The encoded ids are fitted to the requested length so the trajectory's lengths are kept:
    cut if longer, repeated cyclically if shorter. Turns without text fall back to `fallback`.
    """

    texts: Mapping[tuple[int, int], str]
    encode: Callable[[str], Sequence[int]]
    fallback: TokenSource

    def append_ids(self, agent_index: int, turn_index: int, num_tokens: int) -> list[int]:
        text = self.texts.get((agent_index, turn_index))
        if text is None:
            return self.fallback.append_ids(agent_index, turn_index, num_tokens)
        ids = [int(t) for t in self.encode(text)]
        if not ids:
            raise SpecError("TextTokens", f"texts[{agent_index}, {turn_index}]", text,
                            "encodes to no tokens")
        reps = -(-num_tokens // len(ids))
        return (ids * reps)[:num_tokens]


def prompt_ids(
    source: TokenSource, agent_index: int, trajectory: Trajectory, turn_index: int,
    generated: Sequence[Sequence[int]],
) -> list[int]:
    """Prompt ids of `turn_index`: A_0, G_0, ..., A_{i-1}, G_{i-1}, A_i.

    `generated[j]` holds the ids the model produced in turn j (j < turn_index); each must have
    exactly `trajectory.gen_tokens[j]` ids so the prompt's length matches the trajectory.
    """
    if not 0 <= turn_index < trajectory.num_turns:
        raise SpecError("prompt_ids", "turn_index", turn_index,
                        f"must be in [0, {trajectory.num_turns})")
    if len(generated) < turn_index:
        raise SpecError("prompt_ids", "generated", len(generated),
                        f"needs the outputs of the {turn_index} earlier turns")
    ids: list[int] = []
    for j in range(turn_index + 1):
        ids += source.append_ids(agent_index, j, trajectory.append_tokens[j])
        if j < turn_index:
            if len(generated[j]) != trajectory.gen_tokens[j]:
                raise SpecError("prompt_ids", f"generated[{j}]", len(generated[j]),
                                f"must hold gen_tokens[{j}] = {trajectory.gen_tokens[j]} ids")
            ids += [int(t) for t in generated[j]]
    return ids
