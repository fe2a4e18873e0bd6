"""The API's request schemas (pydantic) and their translation into the runtime's requests.

Every field a client may send is declared: OpenAI's, and vLLM's extra sampling parameters.
Each is either honoured or, when set to anything but its neutral value, refused with a 400 that
names it (`REFUSED`); an undeclared field is refused too. Nothing is silently ignored.
`parse_request` turns a JSON body into a `ParsedRequest`: one `GenerateRequest` per choice
(`n` per prompt), every sampling field in one `SamplingParams`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from dualpath.core.errors import SpecError
from dualpath.http.api_error import ApiError, bad_request
from dualpath.runtime.model.sampling import MAX_LOGPROBS, SamplingParams
from dualpath.runtime.model.tokenizer import ChatMessage, Tokenizer, TokenizerError
from dualpath.serve.engine import GenerateRequest

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for `/v1/completions`."""
CHAT_DEFAULT_MAX_TOKENS = 512
"""Chat's default: this, or what the sequence limit leaves after the prompt if less."""
MAX_STOP_STRINGS = 4
MAX_CHOICES = 64
"""The most choices (`n` times the prompts) one request may ask for."""
GREEDY_BELOW = 1e-5
"""A `temperature` below this samples greedily, as dividing logits by a denormal would
overflow them."""


def _utf8(text: str) -> str:
    # JSON may carry a lone surrogate (`"\ud800"`), which no tokenizer can encode.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"is not valid Unicode ({exc.reason} at {exc.start})") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
TokenId = Annotated[int, Field(ge=0)]


class _Strict(BaseModel):
    # strict: no "5" for 5 or true for 1; forbid: an unknown field is refused by name.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[TextPart] | None = None
    name: str | None = None
    """A participant's name: the chat template sees only role and content."""

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


REFUSED: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "parallel_tool_calls": (None,),
    "response_format": (None, {"type": "text"}), "logit_bias": (None, {}),
    "best_of": (None, 1), "store": (None, False), "metadata": (None,),
    "service_tier": (None, "auto", "default"), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,),
    # vLLM's extra parameters
    "use_beam_search": (None, False), "length_penalty": (None, 1.0, 1),
    "allowed_token_ids": (None,), "bad_words": (None, []), "prompt_logprobs": (None,),
    "spaces_between_special_tokens": (None, True), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,),
    "structured_outputs": (None,), "priority": (None, 0), "logits_processors": (None,),
    "return_token_ids": (None, False),
    "cache_salt": (None,), "kv_transfer_params": (None,), "vllm_xargs": (None,),
    "prompt_embeds": (None,), "request_id": (None,), "suffix": (None, ""),
    # declared by one endpoint only
    "continue_final_message": (None, False), "documents": (None,), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "mm_processor_kwargs": (None,),
}
"""Declared fields this server does not implement, with the values that ask for nothing
(accepted); any other value is a 400 naming the field."""


class _Request(_Strict):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    """An end-user id for the caller's own records; it changes no output."""
    # vLLM's extra sampling parameters, all honoured.
    top_k: int = Field(0, ge=-1)
    """-1 or 0: no cut."""
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    stop_token_ids: list[TokenId] | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    """Keep only the prompt's last this many tokens."""
    return_tokens_as_token_ids: bool = False
    """Logprobs name tokens `token_id:<id>` rather than by their text."""
    # Declared, refused unless neutral (REFUSED).
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    logit_bias: Any = None
    best_of: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    prompt_logprobs: Any = None
    spaces_between_special_tokens: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structured_outputs: Any = None
    priority: Any = None
    logits_processors: Any = None
    return_token_ids: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    request_id: Any = None

    @field_validator(*REFUSED, mode="before", check_fields=False)
    @classmethod
    def _refuse(cls, value: Any, info: ValidationInfo) -> Any:
        if any(value == ok and type(value) is type(ok) for ok in REFUSED[info.field_name or ""]):
            return value
        raise ValueError("is not supported by this server")

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise ValueError(f"must be a non-empty string or a list of up to "
                             f"{MAX_STOP_STRINGS}")
        return value

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Request):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool = False
    """True: the tokenizer adds its special tokens (a BOS, where it has one) to text
    prompts."""
    suffix: Any = None
    prompt_embeds: Any = None


class ChatCompletionRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    continue_final_message: Any = None
    documents: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    mm_processor_kwargs: Any = None
    echo: Any = None

    @field_validator("echo", mode="before")
    @classmethod
    def _no_echo(cls, value: Any) -> Any:
        if value not in (None, False):
            raise ValueError("is only supported in /v1/completions")
        return value


class TokenizeRequest(_Strict):
    """vLLM's `/tokenize`: `prompt` text, or chat `messages` in the chat template."""

    model: str | None = None
    prompt: Text | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


# -- errors -----------------------------------------------------------------------------------
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


def field_path(loc: Sequence[int | str]) -> str | None:
    """`("body", "messages", 0, "role")` -> `messages[0].role` (union branch tags left out)."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part:
            continue
        else:
            out += f".{part}" if out else part
    return out or None


def validation_error(errors: Sequence[Any]) -> ApiError:
    """The first of pydantic's errors as OpenAI's 400 naming its field."""
    if not errors:
        return bad_request(None, "invalid request")
    err = errors[0]
    if err.get("type") == "json_invalid":
        return bad_request(None, f"invalid JSON body: {err.get('msg', '')}"[:300])
    param = field_path(err.get("loc", ()))
    if param is None:
        return bad_request(None, "the request body must be a JSON object")
    msg = str(err.get("msg", "invalid"))
    if err.get("type") == "extra_forbidden":
        msg = "is not a field of this request (unknown fields are refused, not ignored)"
    elif err.get("type") == "value_error":
        msg = msg.removeprefix("Value error, ")
    return bad_request(param, msg)


# -- requests for the runtime ----------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    """What one request may ask of the served cluster."""

    model_name: str
    max_sequence_tokens: int
    max_prompt_tokens: int


@dataclass(frozen=True)
class ParsedRequest:
    gens: tuple[GenerateRequest, ...]
    """One per choice, in choice order (prompt by prompt, `n` each). `is_streaming` is set
    for every one: the server sees tokens as they come, cancels a request at its first stop
    string, and counts requests that have begun to decode as running."""
    prompts: tuple[tuple[int, ...], ...]
    """The prompt of each choice (echoed when asked)."""
    stop: tuple[str, ...]
    is_chat: bool
    include_usage: bool
    is_client_streaming: bool
    """The client asked for server-sent events (`stream`)."""
    n: int = 1
    """Choices per prompt: choice `i` is of prompt `i // n`."""
    is_echo: bool = False
    num_logprobs: int | None = None
    is_skip_special_tokens: bool = True
    is_include_stop_str: bool = False
    is_token_ids: bool = False
    """Logprobs name tokens by id (`return_tokens_as_token_ids`)."""

    @property
    def gen(self) -> GenerateRequest:
        """The first choice's request."""
        return self.gens[0]


def check_model(model: str | None, limits: Limits) -> None:
    if model is not None and model != limits.model_name:
        raise ApiError(HTTPStatus.NOT_FOUND, f"model {model!r} does not exist; this server "
                       f"serves {limits.model_name!r}", "model", code="model_not_found")


def parse_request(body: Any, tokenizer: Tokenizer, limits: Limits,
                  is_chat: bool) -> ParsedRequest:
    """A validated request; ApiError (400, or 404 for another model) naming the field."""
    schema = ChatCompletionRequest if is_chat else CompletionRequest
    if not isinstance(body, dict):
        raise bad_request(None, "the request body must be a JSON object")
    try:
        req = schema.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    return to_runtime(req, tokenizer, limits)


def to_runtime(req: ChatCompletionRequest | CompletionRequest, tokenizer: Tokenizer,
               limits: Limits) -> ParsedRequest:
    """The runtime requests of a validated body (ApiError for what the schema cannot see:
    the model name, prompt lengths, field combinations)."""
    check_model(req.model, limits)
    is_chat = isinstance(req, ChatCompletionRequest)
    prompt_param = "messages" if is_chat else "prompt"
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options", "is only allowed with stream: true")
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs", "needs logprobs: true")
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        try:
            prompts = [tokenizer.apply_chat_template(
                [ChatMessage(m.role, m.text()) for m in req.messages],
                req.add_generation_prompt)]
        except TokenizerError as exc:  # the template refused the conversation
            raise bad_request("messages", str(exc)) from None
    else:
        if req.echo and req.logprobs is not None:
            raise bad_request("echo", "with logprobs needs the prompt's logprobs, which this "
                              "server does not compute")
        num_logprobs = req.logprobs
        prompts = _prompts(req, tokenizer)
    if req.truncate_prompt_tokens is not None:
        prompts = [p[-req.truncate_prompt_tokens:] for p in prompts]
    if len(prompts) * req.n > MAX_CHOICES:
        raise bad_request("n", f"{len(prompts)} prompts x n={req.n} choices; at most "
                          f"{MAX_CHOICES} per request")
    longest = max(len(p) for p in prompts)
    if longest > limits.max_prompt_tokens:
        raise bad_request(prompt_param, f"{longest} tokens; at most {limits.max_prompt_tokens} "
                          "are served")
    room = limits.max_sequence_tokens - longest
    if room < 1:
        raise bad_request(prompt_param, f"the prompt's {longest} tokens leave no room in the "
                          f"{limits.max_sequence_tokens}-token sequence limit",
                          code="context_length_exceeded")
    name, max_tokens = "max_tokens", req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        name, max_tokens = "max_completion_tokens", req.max_completion_tokens
    if max_tokens is None:
        max_tokens = min(room, CHAT_DEFAULT_MAX_TOKENS if is_chat
                         else COMPLETION_DEFAULT_MAX_TOKENS)
    if max_tokens > room:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{name}: prompt ({longest} tokens) + "
                       f"{max_tokens} exceeds the {limits.max_sequence_tokens}-token sequence "
                       "limit", name, code="context_length_exceeded")
    temperature = 1.0 if req.temperature is None else req.temperature
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if temperature < GREEDY_BELOW else temperature,
            top_k=max(0, req.top_k),
            top_p=req.top_p,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            seed=req.seed,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            min_tokens=req.min_tokens,
            is_ignore_eos=req.ignore_eos,
            num_logprobs=num_logprobs,
        )
    except SpecError as exc:
        raise bad_request(exc.field, str(exc).split(": ", 1)[-1]) from None
    gens, choice_prompts = [], []
    for prompt in prompts:
        for i in range(req.n):
            # Choices of one seeded request differ, and each is reproducible.
            seed = None if req.seed is None else req.seed + i
            gens.append(GenerateRequest(tuple(prompt), replace(sampling, seed=seed),
                                        is_streaming=True))
            choice_prompts.append(tuple(prompt))
    return ParsedRequest(
        gens=tuple(gens), prompts=tuple(choice_prompts), stop=req.stops, is_chat=is_chat,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        is_client_streaming=req.stream, n=req.n,
        is_echo=bool(getattr(req, "echo", False)),
        num_logprobs=num_logprobs,
        is_skip_special_tokens=req.skip_special_tokens,
        is_include_stop_str=req.include_stop_str_in_output,
        is_token_ids=req.return_tokens_as_token_ids,
    )


def _prompts(req: CompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    """Text, token ids, or a list of either: one prompt each."""
    v = req.prompt
    if isinstance(v, str) or (v and all(isinstance(t, int) for t in v)):
        raw: list[Any] = [v]
    else:
        raw = list(v)
    if not raw:
        raise bad_request("prompt", "is empty")
    out = []
    for i, p in enumerate(raw):
        ids = (tokenizer.encode(p, add_special_tokens=req.add_special_tokens)
               if isinstance(p, str) else list(p))
        if not ids:
            raise bad_request("prompt" if len(raw) == 1 else f"prompt[{i}]", "is empty")
        out.append(ids)
    return out


def finite(value: float) -> float | None:
    """A logprob as JSON can carry it (-inf: None)."""
    return value if math.isfinite(value) else None
