"""The OpenAI-compatible API: request validation and text streaming without a cluster, then a
real server on loopback over an emulated 1P1D cluster (tiny random model, node threads)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from dualpath.runtime.model.model_source import ModelSource, build_model, model_tokenizer
from dualpath.runtime.model.sampling import SamplingParams
from dualpath.runtime.model.tokenizer import ChatMessage, Tokenizer
from dualpath.runtime.run_config import RunConfig
from dualpath.serve import ApiError, ServingEngine, make_server, parse_request
from dualpath.serve.api import ApiServer, TextStream
from dualpath.serve.protocol import Limits

MiB = 2**20
TOK = Tokenizer.byte_level(512)
LIMITS = Limits("tiny", max_sequence_tokens=300, max_prompt_tokens=256)


def parse(body: Any, is_chat: bool = True) -> Any:
    return parse_request(body, TOK, LIMITS, is_chat)


def error_of(body: Any, is_chat: bool = True) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse(body, is_chat)
    return err.value


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


# -- validation -------------------------------------------------------------------------------
def test_tiny_temperatures_are_greedy() -> None:
    assert parse({**CHAT, "temperature": 1e-300}).gen.sampling.temperature == 0.0
    assert parse({**CHAT, "temperature": 0.5}).gen.sampling.temperature == 0.5


def test_chat_request_uses_the_chatml_prompt_and_openai_defaults() -> None:
    req = parse({**CHAT, "model": "tiny", "max_tokens": 5, "seed": 7, "stop": "x"})
    assert list(req.gen.prompt_ids) == TOK.encode_chat([ChatMessage("user", "hi")])
    sampling = req.gen.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.seed) == (5, 1.0, 7)
    assert req.stop == ("x",) and req.is_chat and not req.is_client_streaming
    assert req.gen.is_streaming  # stop strings: the server watches tokens as they come
    parts = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert parts.gen.prompt_ids == req.gen.prompt_ids
    # Without max_tokens a chat reply may use what the sequence limit leaves.
    room = LIMITS.max_sequence_tokens - len(req.gen.prompt_ids)
    assert parse(CHAT).gen.sampling.max_tokens == room


def test_completion_takes_text_or_token_ids() -> None:
    assert parse({"prompt": "abc"}, is_chat=False).gen.prompt_ids == tuple(TOK.encode("abc"))
    ids = parse({"prompt": [5, 6, 7], "max_tokens": 2}, is_chat=False).gen
    assert ids.prompt_ids == (5, 6, 7) and ids.sampling.max_tokens == 2
    assert parse({"prompt": ["abc"]}, is_chat=False).gen.sampling.max_tokens == 16  # OpenAI's


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", 400),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", 400),
        ({"messages": []}, "messages", 400),
        ({**CHAT, "n": 0}, "n", 400),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs", 400),  # needs logprobs: true
        ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", 400),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools", 400),
        ({**CHAT, "no_such_field": 1}, "no_such_field", 400),
        ({**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content",
         400),
        ({**CHAT, "temperature": 3}, "temperature", 400),
        ({**CHAT, "temperature": float("nan")}, "temperature", 400),
        ({**CHAT, "top_p": float("inf")}, "top_p", 400),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options", 400),
        ({**CHAT, "top_p": 0}, "top_p", 400),
        ({**CHAT, "max_tokens": True}, "max_tokens", 400),
        ({**CHAT, "max_tokens": 0}, "max_tokens", 400),
        ({**CHAT, "max_completion_tokens": 10_000}, "max_completion_tokens", 400),
        ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop", 400),
        ({**CHAT, "stream": "yes"}, "stream", 400),
        ({**CHAT, "frequency_penalty": 2.5}, "frequency_penalty", 400),
        ({**CHAT, "model": "gpt-4"}, "model", 404),
    ],
)
def test_invalid_requests_name_the_field(body: dict[str, Any], param: str, status: int) -> None:
    err = error_of(body)
    assert (err.param, err.status) == (param, status)
    assert err.body()["error"]["param"] == param


def test_prompt_limits_are_errors_not_hangs() -> None:
    assert error_of({"prompt": "x" * 257}, is_chat=False).param == "prompt"  # no buffer holds it
    err = error_of({"prompt": "x" * 250, "max_tokens": 51}, is_chat=False)
    assert err.code == "context_length_exceeded" and err.param == "max_tokens"
    assert error_of({"prompt": []}, is_chat=False).param == "prompt"
    assert error_of([1, 2]).status == 400  # not an object


# -- text streaming ---------------------------------------------------------------------------
def test_text_stream_cuts_at_a_stop_string_split_across_tokens() -> None:
    s = TextStream(TOK, ["END"])
    out = [s.push(TOK.encode(p)) for p in ("ab", "cE", "N", "Dxyz")]
    assert out == ["ab", "c", "", ""] and s.text == "abc" and s.is_stopped
    # A tail that never becomes the stop string is released.
    t = TextStream(TOK, ["END"])
    assert t.push(TOK.encode("aE")) == "a"
    assert t.push(TOK.encode("x"), is_final=True) == "Ex" and not t.is_stopped


def test_text_stream_holds_a_split_multibyte_character() -> None:
    ids = TOK.encode("é")
    assert len(ids) == 2  # one token per UTF-8 byte
    s = TextStream(TOK, [])
    assert s.push(ids[:1]) == ""
    assert s.push(ids[1:]) == "é"


# -- a live server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # node threads share this process
    cfg = RunConfig(
        mode="dualpath", store_root=str(tmp_path_factory.mktemp("store")), launch="thread",
        num_prefill_nodes=1, num_decode_nodes=1, engines_per_node=1,
        storage_nic_bytes_per_s=64 * MiB, compute_nic_bytes_per_s=256 * MiB,
        buffer_bytes=16 * MiB, hbm_bytes=32 * MiB, transfer_kind="shm", block_size=16,
    )
    engine = ServingEngine(cfg, model_tokenizer(ModelSource("tiny")), "tiny",
                           request_timeout_s=120)
    srv = make_server(engine, "127.0.0.1", 0, is_logging=False)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    engine.close()
    torch.set_num_threads(before)


def url(srv: ApiServer, path: str) -> str:
    host, port = srv.server_address[:2]
    return f"http://{host!s}:{port}{path}"


def call(srv: ApiServer, path: str, body: Any = None, raw: bytes | None = None
         ) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url(srv, path), data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if text.startswith("data: "):
        events = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return status, [json.loads(e) for e in events[:-1]]
    return status, json.loads(text)


def test_models_health_and_routes(server: ApiServer) -> None:
    assert call(server, "/health") == (200, {"status": "ok"})
    status, models = call(server, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]
    assert call(server, "/v1/nothing")[0] == 404
    assert call(server, "/v1/completions")[0] == 405  # a GET on a POST route
    status, err = call(server, "/v1/chat/completions", raw=b"{not json")
    assert status == 400 and "invalid JSON" in err["error"]["message"]


def test_greedy_completion_equals_the_model_run_in_one_process(server: ApiServer) -> None:
    prompt = list(range(3, 43))
    status, out = call(server, "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
        "ignore_eos": True})
    assert status == 200 and out["object"] == "text_completion"
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length"
    assert out["usage"]["prompt_tokens"] == 40 and out["usage"]["completion_tokens"] == 12
    model = build_model(ModelSource("tiny"))
    ref = model.generate(prompt, SamplingParams(max_tokens=12, is_ignore_eos=True))
    assert choice["text"] == TOK.decode(ref.output_ids, skip_special_tokens=True)


def test_stream_delivers_the_same_reply_in_pieces(server: ApiServer) -> None:
    body = {**CHAT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    _, whole = call(server, "/v1/chat/completions", body)
    status, events = call(server, "/v1/chat/completions",
                          {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 10
    assert all(e["usage"] is None for e in events[:-1])  # OpenAI: null but in the last
    assert all(e["object"] == "chat.completion.chunk" for e in events)


def test_a_follow_up_turn_reads_the_earlier_turns_kv_from_storage(server: ApiServer) -> None:
    first = list(range(100, 180))  # 80 tokens: 5 blocks of 16
    _, a = call(server, "/v1/completions", {"prompt": first, "max_tokens": 8,
                                            "temperature": 0, "ignore_eos": True})
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    reply = TOK.encode(a["choices"][0]["text"]) if a["choices"][0]["text"] else []
    _, b = call(server, "/v1/completions", {"prompt": first + reply + [7, 8, 9],
                                            "max_tokens": 4, "temperature": 0})
    # Every whole block of the first prompt (and of its reply, when it re-encodes to the
    # same ids) was persisted and hits.
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= 80
    _, stats = call(server, "/stats")
    assert stats["cached_tokens"] >= 80 and stats["requests"] >= 2


def test_concurrent_requests_each_get_their_own_reply(server: ApiServer) -> None:
    prompts = [[3 + k] * (20 + 7 * k) for k in range(4)]

    def one(p: list[int]) -> str:
        _, out = call(server, "/v1/completions", {"prompt": p, "max_tokens": 6,
                                                  "temperature": 0, "ignore_eos": True})
        return str(out["choices"][0]["text"])

    alone = [one(p) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(one, prompts))
    assert together == alone


def test_cancel_ends_a_long_generation_early(server: ApiServer) -> None:
    from dualpath.serve import GenerateRequest

    gen = server.engine.generate(GenerateRequest(
        tuple(range(3, 13)), SamplingParams(max_tokens=3000, is_ignore_eos=True),
        is_streaming=True))
    first = next(gen.chunks())
    assert first
    gen.cancel()
    fin = gen.result()
    assert fin.finish_reason == "cancelled"
    assert len(first) <= len(fin.output_ids) < 3000


def test_a_stop_string_cuts_the_reply_and_cancels_the_request(server: ApiServer) -> None:
    body = {"prompt": list(range(20, 40)), "temperature": 0, "ignore_eos": True}
    _, full = call(server, "/v1/completions", {**body, "max_tokens": 40})
    text = full["choices"][0]["text"]
    stop = next((c for c in text[2:] if c.isascii() and c.isprintable()), None)
    if stop is None:  # pragma: no cover - 38 random bytes without one printable ASCII char
        pytest.skip("no printable ASCII character in the reply")
    for stream in (False, True):
        status, out = call(server, "/v1/completions",
                           {**body, "max_tokens": 3000, "stop": stop, "stream": stream,
                            "stream_options": {"include_usage": True}} if stream else
                           {**body, "max_tokens": 3000, "stop": stop})
        assert status == 200
        if stream:
            got = "".join(e["choices"][0]["text"] for e in out if e["choices"])
            finish = [e["choices"][0]["finish_reason"] for e in out if e["choices"]][-1]
            usage = out[-1]["usage"]
        else:
            got, finish, usage = (out["choices"][0]["text"], out["choices"][0]["finish_reason"],
                                  out["usage"])
        assert got == text[: text.index(stop)] and finish == "stop"
        # Counted up to the token that completed the stop string (one byte per token here).
        upto = len(text[: text.index(stop) + 1].encode("utf-8", "surrogatepass"))
        assert usage["completion_tokens"] <= upto + 3


def test_cluster_refusals_and_bad_fields_are_400s(server: ApiServer) -> None:
    status, err = call(server, "/v1/completions", {"prompt": [600, 1]})
    assert status == 400 and err["error"]["param"] == "prompt"  # id outside the vocabulary
    status, err = call(server, "/v1/chat/completions", {**CHAT, "n": 65})
    assert status == 400 and err["error"]["param"] == "n"


def test_serve_help_and_bad_port(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from dualpath.cli.main import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "/v1/chat/completions" in capsys.readouterr().out
    assert main(["serve", "--model", "tiny", "--port", "70000"]) == 2
    assert "port" in capsys.readouterr().err
