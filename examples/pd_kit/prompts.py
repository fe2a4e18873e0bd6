"""The chat the vLLM examples hold: a long system prompt (two KV blocks with a reply) and the
P/D examples' two user turns, as SmolLM2's ChatML."""

from __future__ import annotations

SYSTEM = (
    "You are a patient assistant for a team of storage engineers. They run a cluster of "
    "inference servers whose key-value caches are kept on a distributed file system between "
    "the turns of long agent conversations. Answer in plain prose, with short paragraphs, "
    "and explain each step of your reasoning. When a question is about performance, name "
    "the resource that limits it (compute, memory bandwidth, network or storage) and say "
    "why. When a question is ambiguous, state the assumption you make before answering. "
    "The engineers know the hardware well: each node has eight accelerators, a compute "
    "network for moving activations and caches between nodes, and a separate storage "
    "network whose bandwidth is often idle on the decode nodes while it is saturated on the "
    "prefill nodes. Prefer concrete numbers to adjectives, and say when a number is a guess."
)
USER_1 = "Explain why reading a cached prefix from storage can be faster than recomputing it."
USER_2 = "Now summarise that answer in two sentences."


def chat_prompt(model: str) -> list[int]:
    """The first turn (system prompt and `USER_1`) as token ids, ready for the reply."""
    from dualpath.runtime.model.tokenizer import Tokenizer

    text = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{USER_1}<|im_end|>\n"
            "<|im_start|>assistant\n")
    return list(Tokenizer.from_folder(model).encode(text))
