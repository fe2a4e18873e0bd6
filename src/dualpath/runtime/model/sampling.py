"""How a request picks its tokens: one frozen `SamplingParams`, validated once, carried whole
from the driver through the scheduler to the PE (first token) and the DE (the rest).

`sample` applies, in vLLM's order: `min_tokens` (stop tokens masked until that many are out),
the repetition penalty (prompt and output tokens), presence and frequency penalties (output
tokens), temperature, then `min_p`, `top_k` and `top_p` cuts, and draws. Logprobs, when asked
for, are of the model's raw distribution (vLLM's default `raw_logprobs`), not the processed one.

Sampling is stateless: the token at generation step `i` is drawn with a generator seeded from
`(seed, i)`, so a PE sampling the first token and a DE sampling the rest reproduce a
single-process run exactly.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dualpath.core.errors import SpecError
from dualpath.core.validate import non_negative_int, positive_int

MAX_LOGPROBS = 20
"""The most alternatives a token's logprobs list (OpenAI's chat limit; vLLM's default)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. `temperature == 0` is greedy (argmax of the penalised logits,
    lowest id on ties); the neutral value of every other field changes nothing."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    """Keep the `top_k` most likely tokens; 0: no cut."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose mass reaches `top_p`."""
    min_p: float = 0.0
    """Drop tokens less likely than `min_p` times the most likely one."""
    repetition_penalty: float = 1.0
    """Divide positive (multiply negative) logits of tokens in the prompt or output by it."""
    presence_penalty: float = 0.0
    """Subtract from the logit of every token the output already holds."""
    frequency_penalty: float = 0.0
    """Subtract, times its count in the output, from the logit of every output token."""
    seed: int | None = None
    """None: the cluster derives one per request (its run seed and the request id)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the generation like an EOS (also with `is_ignore_eos`)."""
    min_tokens: int = 0
    """Generate at least this many tokens before an EOS or stop token may end the output."""
    is_ignore_eos: bool = False
    """Generate exactly `max_tokens` tokens even past an EOS (the paper's replay does)."""
    num_logprobs: int | None = None
    """None: no logprobs; k: each token's logprob and its `k` most likely alternatives."""

    def __post_init__(self) -> None:
        owner = "sampling"
        positive_int(owner, "max_tokens", self.max_tokens)
        _finite_in(owner, "temperature", self.temperature, 0.0, math.inf)
        non_negative_int(owner, "top_k", self.top_k)
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise SpecError(owner, "top_p", self.top_p, "must be in (0, 1]")
        _finite_in(owner, "min_p", self.min_p, 0.0, 1.0)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise SpecError(owner, "repetition_penalty", self.repetition_penalty, "must be > 0")
        _finite_in(owner, "presence_penalty", self.presence_penalty, -2.0, 2.0)
        _finite_in(owner, "frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None and not isinstance(self.seed, int):
            raise SpecError(owner, "seed", self.seed, "must be an integer")
        for token in self.stop_token_ids:
            non_negative_int(owner, "stop_token_ids", token)
        non_negative_int(owner, "min_tokens", self.min_tokens)
        if self.min_tokens > self.max_tokens:
            raise SpecError(owner, "min_tokens", self.min_tokens,
                            f"must be <= max_tokens ({self.max_tokens})")
        if self.num_logprobs is not None and not 0 <= self.num_logprobs <= MAX_LOGPROBS:
            raise SpecError(owner, "num_logprobs", self.num_logprobs,
                            f"must be in [0, {MAX_LOGPROBS}]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def stops_at(self, token: int, eos_token_ids: Sequence[int]) -> bool:
        """Whether `token` ends the output (an EOS unless ignored, or a stop token)."""
        return token in self.stop_token_ids or (not self.is_ignore_eos and token in eos_token_ids)


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability and the `num_logprobs` most likely tokens at its
    step (id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Sampled:
    token_id: int
    logprobs: TokenLogprobs | None
    """Set when the request asked for logprobs."""


def sample(logits: torch.Tensor, params: SamplingParams, token_ids: Sequence[int],
           num_prompt_tokens: int, eos_token_ids: Sequence[int] = ()) -> Sampled:
    """The next token after `token_ids` (prompt then output so far) from `logits` (`[vocab]`);
    its step is the number of output tokens so far."""
    step = len(token_ids) - num_prompt_tokens
    scores = _processed(logits, params, token_ids, num_prompt_tokens, eos_token_ids, step)
    token = int(torch.argmax(scores).item()) if params.is_greedy else _draw(scores, params, step)
    lp = None if params.num_logprobs is None else _logprobs(logits, token, params.num_logprobs)
    return Sampled(token, lp)


def _processed(logits: torch.Tensor, params: SamplingParams, token_ids: Sequence[int],
               num_prompt_tokens: int, eos_token_ids: Sequence[int], step: int) -> torch.Tensor:
    """The logits after `min_tokens` and the penalties (`logits` itself when none apply, so
    plain greedy decoding is the argmax of the model's own logits, bit for bit)."""
    is_min_tokens = step < params.min_tokens
    if not is_min_tokens and not params.has_penalties:
        return logits
    scores = logits.detach().to("cpu", torch.float64).clone()
    vocab = scores.numel()
    if is_min_tokens:
        stops = {*params.stop_token_ids, *(() if params.is_ignore_eos else eos_token_ids)}
        ids = [t for t in stops if t < vocab]
        if ids:
            scores[torch.tensor(ids)] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.unique(torch.tensor(list(token_ids), dtype=torch.long))
        seen = seen[seen < vocab]
        vals = scores[seen]
        p = params.repetition_penalty
        scores[seen] = torch.where(vals > 0, vals / p, vals * p)
    if (params.presence_penalty or params.frequency_penalty) and step > 0:
        out = torch.tensor(list(token_ids[num_prompt_tokens:]), dtype=torch.long)
        counts = torch.bincount(out[out < vocab], minlength=vocab).to(torch.float64)
        scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return scores


def _draw(scores: torch.Tensor, params: SamplingParams, step: int) -> int:
    scores = scores.detach().to("cpu", torch.float64) / params.temperature
    if params.top_k and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= params.top_p
        probs = probs.scatter(0, order[drop], 0.0)
        probs = probs / probs.sum()
    digest = hashlib.blake2b(f"{params.seed or 0}:{step}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return int(torch.multinomial(probs, 1, generator=gen).item())


def _logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    lp = torch.log_softmax(logits.detach().to("cpu", torch.float64), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if k:
        values, ids = torch.topk(lp, min(k, lp.numel()))
        top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(token, float(lp[token].item()), top)


def _finite_in(owner: str, name: str, value: float, lo: float, hi: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and lo <= value <= hi):
        span = f">= {lo:g}" if hi == math.inf else f"in [{lo:g}, {hi:g}]"
        raise SpecError(owner, name, value, f"must be a finite number {span}")
