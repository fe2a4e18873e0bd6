"""Byte-level BPE tokenizers (GPT-2 style, as SmolLM2, Llama 3 and Qwen2 use), built from a
GGUF vocabulary or loaded from a HF `tokenizer.json`, plus the ChatML chat format."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from dualpath.core.errors import DualPathError
from dualpath.runtime.model.gguf import metadata, open_gguf

GGUF_CONTROL_TOKEN = 3
"""`tokenizer.ggml.token_type` of control (special) tokens."""


class TokenizerError(DualPathError):
    """A tokenizer file that cannot be loaded; the message names it."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class Tokenizer:
    """Text <-> token ids. Special tokens (`<|im_start|>` ...) map to their single ids."""

    def __init__(self, inner: HFTokenizer, eos_token_ids: Sequence[int] = (),
                 chat_template: str | None = None, bos_token: str = "") -> None:
        self.inner = inner
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        """The model's own Jinja chat template (HF `tokenizer_config.json` or GGUF
        `tokenizer.chat_template`); None: ChatML (`chat_text`)."""
        self.bos_token = bos_token
        """The BOS token's text, for templates that write `{{ bos_token }}`."""

    @property
    def vocab_size(self) -> int:
        return int(self.inner.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text` (no BOS/EOS added unless asked for; chat formatting adds its
        own markers)."""
        return list(self.inner.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_id(self, token: str) -> int:
        """The id of one vocabulary entry (e.g. "<|im_end|>")."""
        tid = self.inner.token_to_id(token)
        if tid is None:
            raise TokenizerError(f"token {token!r} is not in the vocabulary")
        return int(tid)

    @staticmethod
    def chat_text(messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """ChatML (SmolLM2, Qwen2): `<|im_start|>role\\ncontent<|im_end|>\\n` per message, then
        `<|im_start|>assistant\\n` to prompt a reply."""
        text = "".join(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def encode_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode(self.chat_text(messages, add_generation_prompt))

    def apply_chat_template(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of `messages` in the model's own chat template (as HF `transformers`
        renders it: sandboxed Jinja, `trim_blocks`, `lstrip_blocks`), ChatML without one.
        TokenizerError when the template rejects the conversation (its `raise_exception`)
        or cannot be rendered."""
        if self.chat_template is None:
            return self.encode_chat(messages, add_generation_prompt)
        return self.encode(render_chat_template(
            self.chat_template, messages, add_generation_prompt,
            eos_token=self.decode(self.eos_token_ids[:1]) if self.eos_token_ids else "",
            bos_token=self.bos_token,
        ))

    @classmethod
    def byte_level(cls, vocab_size: int) -> Tokenizer:
        """One token per UTF-8 byte (ids 1-256), `<|endoftext|>` (EOS) at 0 and the ChatML
        markers at 257-258: text round-trips through any model with at least 259 ids (the
        runtime's random-weight `tiny` model, whose output is noise)."""
        if vocab_size < 259:
            raise TokenizerError(f"a byte-level tokenizer needs vocab_size >= 259, got "
                                 f"{vocab_size}")
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 characters, one per byte
        vocab = {"<|endoftext|>": 0, **{ch: i + 1 for i, ch in enumerate(alphabet)},
                 "<|im_start|>": 257, "<|im_end|>": 258}
        inner = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
        inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        inner.decoder = decoders.ByteLevel()
        inner.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
        return cls(inner, (0,))

    # -- files -----------------------------------------------------------------------------
    def save(self, folder: Path | str) -> Path:
        """Write `tokenizer.json` into `folder` (eos ids go into the model's config.json)."""
        path = Path(folder) / "tokenizer.json"
        self.inner.save(str(path))
        return path

    @classmethod
    def from_folder(cls, folder: Path | str, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Load `tokenizer.json` from a checkpoint folder (or the file itself), with the chat
        template of the folder's `tokenizer_config.json` when it has one."""
        path = Path(folder)
        if path.is_dir():
            path = path / "tokenizer.json"
        try:
            inner = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception
            raise TokenizerError(f"{path}: cannot load tokenizer ({exc})") from None
        template, bos = _folder_chat_config(path.parent)
        return cls(inner, eos_token_ids, template, bos)

    @classmethod
    def from_gguf(cls, path: Path | str) -> Tokenizer:
        """Build the tokenizer stored in a GGUF file's `tokenizer.ggml.*` metadata."""
        return cls.from_gguf_reader(open_gguf(path), str(path))

    @classmethod
    def from_gguf_reader(cls, reader: Any, where: str) -> Tokenizer:
        """As `from_gguf`, from an open `gguf.GGUFReader` (`where` names it in errors)."""

        def meta(key: str) -> Any:
            return metadata(reader, key, where, TokenizerError)

        kind = meta("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(f"{where}: tokenizer.ggml.model={kind!r}, only gpt2 (BPE)")
        tokens: list[str] = list(meta("tokenizer.ggml.tokens"))
        types: list[int] = list(meta("tokenizer.ggml.token_type"))
        merges = [tuple(m.split(" ", 1)) for m in meta("tokenizer.ggml.merges")]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        inner = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
        pre = meta("tokenizer.ggml.pre") if "tokenizer.ggml.pre" in reader.fields else "default"
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre == "smollm":
            # SmolLM's tokenizer.json: every digit its own token, then GPT-2 byte level.
            inner.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            inner.pre_tokenizer = byte_level
        inner.decoder = decoders.ByteLevel()
        inner.add_special_tokens([
            AddedToken(tok, special=True, normalized=False)
            for tok, kind_id in zip(tokens, types, strict=True)
            if kind_id == GGUF_CONTROL_TOKEN
        ])
        eos = reader.fields.get("tokenizer.ggml.eos_token_id")
        template = reader.fields.get("tokenizer.chat_template")
        bos = reader.fields.get("tokenizer.ggml.bos_token_id")
        return cls(inner, (int(eos.contents()),) if eos is not None else (),
                   str(template.contents()) if template is not None else None,
                   tokens[int(bos.contents())] if bos is not None else "")


def _folder_chat_config(folder: Path) -> tuple[str | None, str]:
    """`(chat_template, bos_token)` of `folder/tokenizer_config.json`: the template a string,
    or HF's list of named templates (the "default" one), or None; the BOS token's text ("" if
    none)."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return None, ""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        raw = config.get("chat_template")
        bos = config.get("bos_token") or ""
    except (OSError, ValueError, AttributeError) as exc:
        raise TokenizerError(f"{path}: cannot read chat_template ({exc})") from None
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        raw = named.get("default")
    if raw is not None and not isinstance(raw, str):
        raise TokenizerError(f"{path}: chat_template must be a string or a list of "
                             "{name, template}")
    if isinstance(bos, dict):  # an AddedToken written out: {"content": ..., ...}
        bos = bos.get("content") or ""
    if not isinstance(bos, str):
        raise TokenizerError(f"{path}: bos_token must be a string")
    return raw, bos


def render_chat_template(template: str, messages: Sequence[ChatMessage],
                         add_generation_prompt: bool = True, eos_token: str = "",
                         bos_token: str = "") -> str:
    """`template` rendered for `messages` as HF `transformers` does (sandboxed Jinja with
    `trim_blocks` and `lstrip_blocks`, `raise_exception` available to the template)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TokenizerError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt, eos_token=eos_token,
            bos_token=bos_token,
        )
    except TemplateError as exc:
        raise TokenizerError(f"chat template cannot be rendered: {exc}") from None
