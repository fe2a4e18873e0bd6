"""The API as vLLM users meet it: the real `openai` client against a real uvicorn server on
loopback over an emulated 1P1D cluster (tiny random model, node threads). One test per item of
issue 18: concurrency and connections, timeouts, /metrics, the API key, the sampling surface,
the extra endpoints, and the edge cases."""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from dualpath.runtime.model.llama import Model
from dualpath.runtime.model.model_source import ModelSource, build_model, model_tokenizer
from dualpath.runtime.model.sampling import SamplingParams
from dualpath.runtime.run_config import RunConfig
from dualpath.serve import ServerConfig, ServingEngine, make_server
from dualpath.serve.api import ApiServer

MiB = 2**20
KEY = "sk-test-key"


@contextmanager
def served(engine: ServingEngine, config: ServerConfig | None = None
           ) -> Iterator[ApiServer]:
    srv = make_server(engine, "127.0.0.1", 0, is_logging=False, config=config)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServingEngine]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # node threads share this process
    cfg = RunConfig(
        mode="dualpath", store_root=str(tmp_path_factory.mktemp("store")), launch="thread",
        num_prefill_nodes=1, num_decode_nodes=1, engines_per_node=1,
        storage_nic_bytes_per_s=64 * MiB, compute_nic_bytes_per_s=256 * MiB,
        buffer_bytes=16 * MiB, hbm_bytes=64 * MiB, transfer_kind="shm", block_size=16,
        stats_interval_s=0.2,
    )
    with ServingEngine(cfg, model_tokenizer(ModelSource("tiny")), "tiny",
                       request_timeout_s=300) as eng:
        yield eng
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def server(engine: ServingEngine) -> Iterator[ApiServer]:
    with served(engine) as srv:
        yield srv


def base(srv: ApiServer) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.fixture(scope="module")
def client(server: ApiServer) -> openai.OpenAI:
    # No retries: a connection error must show, not be retried away.
    return openai.OpenAI(base_url=base(server) + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model() -> Model:
    return build_model(ModelSource("tiny"))


def reference(model: Model, prompt: list[int], **sampling: Any) -> list[int]:
    """The output of the model run in one process (no cluster, no HTTP)."""
    return list(model.generate(prompt, SamplingParams(**sampling)).output_ids)


def completion_ids(client: openai.OpenAI, prompt: list[int], **fields: Any) -> list[int]:
    """The completion's token ids, through its logprobs (random-model text is not ids)."""
    out = client.completions.create(model="tiny", prompt=prompt, logprobs=0, extra_body={
        "ignore_eos": True, "return_tokens_as_token_ids": True, **fields.pop("extra", {})},
        **fields)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None
    return [int(t.removeprefix("token_id:")) for t in lp.tokens]


# -- 1. concurrency, keep-alive, client drops ------------------------------------------------
def test_256_concurrent_streams_complete_and_equal_the_sequential_replies(
        server: ApiServer, client: openai.OpenAI) -> None:
    prompts = [[3 + k, 5, 7 + k, 9, 11 + 2 * k] for k in range(8)]
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0}

    sequential = [client.completions.create(prompt=p, extra_body={"ignore_eos": True}, **body)
                  .choices[0].text for p in prompts]

    async def one(ac: openai.AsyncOpenAI, k: int) -> str:
        stream = await ac.completions.create(prompt=prompts[k % 8], stream=True,
                                             extra_body={"ignore_eos": True}, **body)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_at_once() -> list[str | BaseException]:
        async with openai.AsyncOpenAI(base_url=base(server) + "/v1", api_key="unused",
                                      max_retries=0, timeout=600) as ac:
            return await asyncio.gather(*(one(ac, k) for k in range(256)),
                                        return_exceptions=True)

    together = asyncio.run(all_at_once())
    errors = [r for r in together if isinstance(r, BaseException)]
    assert errors == []
    assert together == [sequential[k % 8] for k in range(256)]


def test_connections_are_kept_alive_and_a_dropped_client_leaves_no_traceback(
        server: ApiServer, capfd: pytest.CaptureFixture[str]) -> None:
    port = server.server_address[1]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for _ in range(2):
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": [5, 6, 7], "max_tokens": 3, "stream": True}),
            headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Connection") != "close"
        assert r.read().endswith(b"data: [DONE]\n\n")
    first_sock = conn.sock
    conn.request("GET", "/health")
    assert conn.getresponse().read() and conn.sock is first_sock  # the same connection
    conn.close()
    # A client that resets its connection mid-stream: its request is cancelled, quietly.
    s = socket.create_connection(("127.0.0.1", port))
    payload = json.dumps({"prompt": [5, 6, 7], "max_tokens": 3000, "stream": True,
                          "ignore_eos": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
              b"\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    got = b""
    while b"data: " not in got:
        got += s.recv(4096)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
    s.close()
    deadline = time.monotonic() + 60
    while server.engine.num_in_flight() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.engine.num_in_flight() == (0, 0)  # cancelled, not decoding 3000 tokens
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ConnectionResetError" not in err


# -- 2. timeouts ------------------------------------------------------------------------------
def test_slow_and_idle_clients_are_cut_at_the_timeout(engine: ServingEngine) -> None:
    cfg = ServerConfig(head_timeout_s=0.5, body_timeout_s=0.5, keep_alive_s=1.0)
    with served(engine, cfg) as srv:
        port = srv.server_address[1]
        socks = []
        for head in (b"", b"GET /health HTTP/1.1\r\nHost: x\r\n",  # silent; a slow head
                     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(head)
            socks.append(s)
        for s in socks[:2]:
            assert s.recv(4096) == b""  # closed by the server, not by our 30 s timeout
        assert b"408" in socks[2].recv(4096).split(b"\r\n")[0]  # the body never came
        for s in socks:
            s.close()
        # An idle kept-alive connection is closed after keep_alive_s.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/health")
        conn.getresponse().read()
        assert conn.sock is not None and conn.sock.recv(1) == b""


# -- 3. /metrics --------------------------------------------------------------------------------
def test_metrics_parse_and_match_stats(server: ApiServer, client: openai.OpenAI) -> None:
    first = list(range(40, 90))  # 3 whole blocks of 16, persisted once served
    client.completions.create(model="tiny", prompt=first, max_tokens=5,
                              extra_body={"ignore_eos": True})
    client.completions.create(model="tiny", prompt=[*first, 1, 2, 3], max_tokens=5,
                              extra_body={"ignore_eos": True})
    time.sleep(0.5)  # the nodes report their counters every 0.2 s

    def scrape() -> tuple[dict[str, float], dict[str, Any]]:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.request("GET", "/stats")
        stats = json.loads(conn.getresponse().read())
        conn.close()
        samples = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                  if k != "model_name")
                samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return samples, stats

    m, stats = scrape()
    assert m["vllm:prompt_tokens_total"] == stats["prompt_tokens"] > 0
    assert m["vllm:generation_tokens_total"] == stats["generated_tokens"] > 0
    assert m["vllm:request_success_total"] == stats["finished"]
    assert m["vllm:prefix_cache_queries_total"] == stats["prompt_tokens"]
    assert m["vllm:prefix_cache_hits_total"] == stats["cached_tokens"] >= 48
    assert m["dualpath:storage_tokens_total"] == stats["cached_tokens"]
    assert m["dualpath:cluster_restarts_total"] == stats["restarts"] == 0
    assert m["vllm:num_requests_running"] == stats["running"] == 0
    assert m["vllm:num_requests_waiting"] == stats["waiting"] == 0
    storage = stats["storage"]
    read = storage["read_bytes"]
    assert (m["dualpath:storage_read_bytes_total{path=pe}"],
            m["dualpath:storage_read_bytes_total{path=de}"]) == (read["pe"], read["de"])
    assert read["pe"] + read["de"] > 0  # the follow-up read its hit blocks from storage
    for reason, n in storage["recomputed_blocks"].items():
        assert m[f"dualpath:recomputed_blocks_total{{reason={reason}}}"] == n
    for node in storage["nodes"]:
        key = f"{{node={node['node']},side={node['side']}}}"
        assert m["dualpath:storage_nic_busy_seconds_total" + key] == \
            node["storage_read_busy_s"]
        assert 0.0 <= m["dualpath:storage_nic_utilization" + key] <= 1.0
        assert m["dualpath:storage_read_queue_tokens" + key] == node["read_queue_tokens"]
    assert len(storage["nodes"]) == 2
    # Observed per reply the API finished (not the earlier test's dropped stream).
    assert 0 < m["vllm:time_to_first_token_seconds_count"] <= stats["finished"]
    assert m["vllm:e2e_request_latency_seconds_count"] == \
        m["vllm:time_to_first_token_seconds_count"]
    assert m["vllm:inter_token_latency_seconds_count"] > 0


# -- 4. the API key -----------------------------------------------------------------------------
def test_an_api_key_is_required_when_set(engine: ServingEngine,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with served(engine, ServerConfig(api_key=KEY)) as srv:
        url = base(srv) + "/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
        assert [m.id for m in good.models.list()] == ["tiny"]
        conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
        conn.request("GET", "/health")  # open, as vLLM's
        assert conn.getresponse().status == 200
    from dualpath.cli.main import build_parser

    monkeypatch.setenv("DUALPATH_API_KEY", KEY)
    assert build_parser().parse_args(["serve"]).api_key == KEY


# -- 5. the sampling surface --------------------------------------------------------------------
PROMPT = [30, 31, 32, 33, 34, 35]


@pytest.mark.parametrize("fields", [
    {"repetition_penalty": 1.8},
    {"presence_penalty": 1.5, "frequency_penalty": 0.7},
    {"temperature": 0.9, "top_k": 3, "seed": 11},
    {"temperature": 0.9, "min_p": 0.3, "seed": 12},
    {"temperature": 0.9, "top_p": 0.5, "seed": 13},
])
def test_sampling_fields_match_the_single_process_model(
        client: openai.OpenAI, model: Model, fields: dict[str, Any]) -> None:
    fields = {"temperature": 0.0, **fields}
    ref = reference(model, PROMPT, max_tokens=10, is_ignore_eos=True, **fields)
    plain = reference(model, PROMPT, max_tokens=10, is_ignore_eos=True,
                      temperature=fields["temperature"], seed=fields.get("seed"))
    assert ref != plain  # each field changes this output, so it is honoured, not ignored
    std = {k: fields.pop(k) for k in ("temperature", "seed", "presence_penalty",
                                      "frequency_penalty", "top_p") if k in fields}
    assert completion_ids(client, PROMPT, max_tokens=10, extra=fields, **std) == ref


def test_top_k_1_is_greedy_whatever_the_seed(client: openai.OpenAI) -> None:
    greedy = completion_ids(client, PROMPT, max_tokens=8, temperature=0)
    for seed in (1, 2, 3):
        assert completion_ids(client, PROMPT, max_tokens=8, temperature=1.0, seed=seed,
                              extra={"top_k": 1}) == greedy


def test_stop_token_ids_and_min_tokens(client: openai.OpenAI, model: Model) -> None:
    greedy = reference(model, PROMPT, max_tokens=12, is_ignore_eos=True)
    stop = greedy[3]
    cut = greedy.index(stop)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                    logprobs=0, extra_body={"stop_token_ids": [stop]})
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.completion_tokens == cut  # the stop token left out
    # min_tokens masks the stop token until that many tokens are out.
    ref = reference(model, PROMPT, max_tokens=12, stop_token_ids=(stop,), min_tokens=cut + 3)
    assert len(ref) > cut
    got = completion_ids(client, PROMPT, max_tokens=12, temperature=0,
                         extra={"stop_token_ids": [stop], "min_tokens": cut + 3,
                                "ignore_eos": False})
    assert got == [t for t in ref if t != stop]


def test_logprobs_in_completions_and_chat(client: openai.OpenAI, model: Model) -> None:
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    logits, _ = model.prefill(PROMPT)
    want = torch.log_softmax(logits.double(), -1).max().item()
    assert math.isclose(lp.token_logprobs[0], want, rel_tol=1e-6)  # greedy: the top one
    for top, value in zip(lp.top_logprobs, lp.token_logprobs, strict=True):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(value)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_n_choices_and_echo(client: openai.OpenAI) -> None:
    many = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=3,
                                     temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1, 2]
    texts = [c.text for c in many.choices]
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=3,
                                      temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == texts and len(set(texts)) > 1
    assert many.usage is not None and many.usage.completion_tokens == 18
    assert many.usage.prompt_tokens == len(PROMPT)  # one prompt, counted once
    chats = client.chat.completions.create(model="tiny", n=2, max_tokens=3, temperature=0,
                                           messages=[{"role": "user", "content": "hi"}])
    assert len({c.message.content for c in chats.choices}) == 1  # greedy: the same twice
    echoed = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, echo=True,
                                       temperature=0)
    assert echoed.choices[0].text.startswith("Hello")


VLLM_EXTRA_SAMPLING = {
    # vLLM's documented extra parameters of /v1/completions and /v1/chat/completions, each
    # with a value that asks for something.
    "use_beam_search": True, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2,
    "length_penalty": 0.5, "stop_token_ids": [7], "include_stop_str_in_output": True,
    "ignore_eos": True, "min_tokens": 2, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "truncate_prompt_tokens": 3,
    "allowed_token_ids": [1, 2], "prompt_logprobs": 1, "bad_words": ["x"],
    "add_special_tokens": True, "response_format": {"type": "json_object"},
    "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["a"],
    "guided_grammar": "root ::= 'a'", "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ", "structured_outputs": {"regex": "a"}, "priority": 1,
    "logits_processors": ["x"], "return_tokens_as_token_ids": True, "return_token_ids": True,
    "cache_salt": "s", "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1},
    "request_id": "r1", "echo": True, "seed": 3, "logit_bias": {"5": 1.0},
    "add_generation_prompt": False, "continue_final_message": True, "documents": [{"a": "b"}],
    "chat_template": "{{ messages }}", "chat_template_kwargs": {"a": 1},
    "mm_processor_kwargs": {"a": 1}, "prompt_embeds": "AAAA",
}
HONOURED = {"top_k", "min_p", "repetition_penalty", "stop_token_ids",
            "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
            "truncate_prompt_tokens", "add_special_tokens", "seed", "echo",
            "add_generation_prompt", "return_tokens_as_token_ids"}
"""Each has a test above or in test_api.py that shows its effect."""


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_every_vllm_extra_parameter_is_honoured_or_refused_by_name(
        server: ApiServer, route: str) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
    is_chat = route == "chat"
    path = "/v1/chat/completions" if is_chat else "/v1/completions"
    body: dict[str, Any] = ({"messages": [{"role": "user", "content": "hi"}]} if is_chat
                            else {"prompt": "hello"})
    outcomes = {}
    for name, value in VLLM_EXTRA_SAMPLING.items():
        conn.request("POST", path, body=json.dumps({**body, "max_tokens": 3, name: value}),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        out = json.loads(r.read())
        if r.status == 200:
            outcomes[name] = "honoured"
        else:
            assert r.status == 400 and out["error"]["param"] == name, (name, out)
            outcomes[name] = "refused"
    conn.close()
    honoured = {n for n, o in outcomes.items() if o == "honoured"}
    # echo is a completions field, add_special_tokens / add_generation_prompt one endpoint's.
    expected = HONOURED - ({"echo", "add_special_tokens"} if is_chat
                           else {"add_generation_prompt"})
    assert honoured == expected


def test_include_stop_str_truncate_and_skip_special_tokens(client: openai.OpenAI,
                                                           model: Model) -> None:
    prompt = list(range(20, 40))
    long = client.completions.create(model="tiny", prompt=prompt, max_tokens=40,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = long.choices[0].text
    stop = next((c for c in text[2:] if c.isascii() and c.isprintable()), None)
    if stop is None:  # pragma: no cover - random bytes without one printable ASCII char
        pytest.skip("no printable ASCII character in the reply")
    with_stop = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=stop,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert with_stop.choices[0].text == text[: text.index(stop) + 1]
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20,
                                     temperature=0, extra_body={"ignore_eos": True})
    cut = client.completions.create(model="tiny", prompt=[99, 98, *PROMPT], max_tokens=5,
                                    temperature=0, extra_body={"ignore_eos": True,
                                                               "truncate_prompt_tokens": 6})
    assert cut.usage is not None and cut.usage.prompt_tokens == 6
    assert cut.choices[0].text == full.choices[0].text[: len(cut.choices[0].text)]
    special = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                        temperature=0, extra_body={"ignore_eos": True,
                                                                   "skip_special_tokens": False})
    assert special.choices[0].text.startswith(full.choices[0].text[:1])


# -- 6. endpoints -------------------------------------------------------------------------------
def test_models_tokenize_detokenize_version_and_prompt_lists(server: ApiServer,
                                                              client: openai.OpenAI) -> None:
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)

    def post(path: str, body: object) -> Any:
        conn.request("POST", path, body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        return json.loads(conn.getresponse().read())

    tokens = post("/tokenize", {"prompt": "héllo"})
    assert tokens["count"] == len(tokens["tokens"]) == 6  # one token per UTF-8 byte
    assert post("/detokenize", {"tokens": tokens["tokens"]}) == {"prompt": "héllo"}
    chat_ids = post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})["tokens"]
    assert chat_ids[0] == 257  # <|im_start|>
    conn.request("GET", "/version")
    assert "version" in json.loads(conn.getresponse().read())
    conn.close()
    two = client.completions.create(model="tiny", prompt=["ab", "cd"], max_tokens=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
             for p in ("ab", "cd")]
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text for c in two.choices] == alone


# -- 8. edge cases ------------------------------------------------------------------------------
def test_a_lone_surrogate_is_a_400_and_a_get_on_a_post_route_a_405(
        server: ApiServer, client: openai.OpenAI) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
    conn.request("POST", "/v1/completions", body=b'{"prompt": "a\\ud800b"}',
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 400 and json.loads(r.read())["error"]["param"] == "prompt"
    conn.request("GET", "/v1/chat/completions")
    r = conn.getresponse()
    assert r.status == 405 and "error" in json.loads(r.read())
    conn.close()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function",
                                               "function": {"name": "f", "parameters": {}}}])
    assert err.value.body["param"] == "tools"  # type: ignore[index]

