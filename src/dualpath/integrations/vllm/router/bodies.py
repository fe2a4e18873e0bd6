"""What the router sends each instance: the prefill and decode bodies built from the client's,
and the `/tokenize` request for its prompt."""

from __future__ import annotations

from typing import Any

from dualpath.http.api_error import bad_request
from dualpath.integrations.vllm.manifest import RouteParams

PREFILL_DROPPED = ("stream_options", "min_tokens", "max_completion_tokens")
CHAT_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template",
                        "chat_template_kwargs", "tools", "documents", "add_special_tokens")
"""Chat fields that change the prompt's tokens, forwarded to `/tokenize`."""
_INT = frozenset((int,))


def prefill_body(body: dict[str, Any], is_chat: bool, params: RouteParams) -> dict[str, Any]:
    """What the prefill instance gets: one token, no stream, one choice, the router's orders."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
    out.update(max_tokens=1, stream=False, n=1, kv_transfer_params=params.to_params())
    if is_chat:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: Any) -> dict[str, Any]:
    """The client's body with the prefill reply's `kv_transfer_params` (if it had any)."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if kv_transfer_params:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def gen_tokens(body: dict[str, Any]) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad_request(name, "must be a non-negative integer")
            return int(value)
    return 0


def is_token_ids(value: Any) -> bool:
    """A list of plain ints (JSON's; not bools), checked at C speed (prompts are long)."""
    return isinstance(value, list) and _INT.issuperset(map(type, value))


def tokenize_request(body: dict[str, Any], is_chat: bool,
                     model: str | None) -> list[int] | dict[str, Any]:
    """The prompt's own token ids when the body gives them, else the `/tokenize` request that
    yields them (`model`: the router's default model, for a body that names none)."""
    req: dict[str, Any] = {}
    model = body.get("model", model)
    if model is not None:
        req["model"] = model
    if is_chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages", "must be a non-empty list")
        req["messages"] = messages
        req.update({k: body[k] for k in CHAT_TEMPLATE_FIELDS if k in body})
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not is_token_ids(prompt):
            prompt = prompt[0]
        if is_token_ids(prompt) and prompt:
            return list(prompt)
        if not isinstance(prompt, str) or not prompt:
            raise bad_request("prompt", "must be one non-empty string or list of token "
                              "ids (the router routes one prompt per request)")
        req["prompt"] = prompt
        if "add_special_tokens" in body:
            req["add_special_tokens"] = body["add_special_tokens"]
    return req
