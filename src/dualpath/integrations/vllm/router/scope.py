"""A request body's key scope, as the connectors will key its blocks (`core.blocks.KeyScope`:
the tenant's `cache_salt`, the LoRA adapter the body's `model` names, its multimodal inputs),
so the router counts a prompt's stored prefix by the connectors' keys, never across tenants
or adapters.

The router cannot hash a multimodal input or prompt embeddings as vLLM does: such a request
counts no hit (no read is scheduled for it; its prefill computes what its own instance's
prefix cache lacks). An adapter's path comes from the instances' `/v1/models` (vLLM lists each
adapter with its path as `root` and its base model as `parent`); a model name no instance
lists counts no hit either.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from dualpath.core.blocks import NO_SCOPE, KeyScope
from dualpath.http.api_error import bad_request

MEDIA_FIELDS = ("prompt_embeds", "multi_modal_data", "mm_processor_kwargs")
"""Body fields that carry inputs beside the prompt's text or token ids."""
REFRESH_AFTER_S = 5.0
"""An unknown model name asks the instances again at most this often."""


def cache_salt(body: dict[str, Any]) -> str | None:
    """The body's `cache_salt` (vLLM's field); a non-string one is a 400, as vLLM's."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request("cache_salt", "must be a non-empty string")
    return salt


def has_media(body: dict[str, Any], is_chat: bool) -> bool:
    """Whether the body carries anything but text and token ids into the prompt."""
    if any(body.get(k) is not None for k in MEDIA_FIELDS):
        return True
    if is_chat:
        for message in body.get("messages") or ():
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(
                    not isinstance(part, dict) or part.get("type") != "text"
                    for part in content):
                return True
        return False
    return isinstance(body.get("prompt"), dict)


class ModelCatalog:
    """The instances' base models and LoRA adapters (name -> path), from `/v1/models`."""

    def __init__(self, fetch: Callable[[], Awaitable[Any]], default_model: str | None
                 ) -> None:
        self._fetch = fetch
        """Returns an instance's `/v1/models` reply (its JSON), or raises."""
        self.base: set[str] = {default_model} if default_model else set()
        self.adapters: dict[str, str] = {}
        self._asked_at = -REFRESH_AFTER_S

    async def adapter_of(self, model: str | None) -> tuple[str, str] | None | bool:
        """(name, path) of the adapter `model` names, None for a base model, False when no
        instance lists it."""
        if model is None or model in self.base:
            return None
        if model not in self.adapters and time.monotonic() - self._asked_at >= REFRESH_AFTER_S:
            self._asked_at = time.monotonic()
            # No instance answers now: the name stays unknown (no hit) until the next ask.
            with contextlib.suppress(Exception):
                self.learn(await self._fetch())
        if model in self.base:
            return None
        path = self.adapters.get(model)
        return (model, path) if path is not None else False

    def learn(self, models: Any) -> None:
        """Take vLLM's `/v1/models` reply: cards with a `parent` are adapters."""
        for card in models.get("data", ()) if isinstance(models, dict) else ():
            if not isinstance(card, dict) or not isinstance(card.get("id"), str):
                continue
            if card.get("parent"):
                self.adapters[card["id"]] = str(card.get("root") or card["id"])
            else:
                self.base.add(card["id"])


async def body_scope(body: dict[str, Any], is_chat: bool, catalog: ModelCatalog
                     ) -> KeyScope | None:
    """The scope the connectors will key the body's blocks in; None: they cannot be keyed
    from the body (no hit is counted)."""
    salt = cache_salt(body)
    if has_media(body, is_chat):
        return None
    adapter = await catalog.adapter_of(body.get("model"))
    if adapter is False:
        return None
    assert adapter is None or isinstance(adapter, tuple)
    if salt is None and adapter is None:
        return NO_SCOPE
    return KeyScope(cache_salt=salt, adapter=adapter)
