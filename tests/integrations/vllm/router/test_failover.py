"""The router's failover against stand-in vLLM instances in processes of their own
(`fake_instance.py`), killed with SIGKILL mid-request as a crashing server would be: an
instance marked down and excluded, its return, a request retried on another instance before
its first token, a stream that breaks after it, `/health`, the trace id."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fake_instance import reply_text, stream_words
from fakes import PROMPT, Fake, complete, routed, side, stats, wait_until

from dualpath.integrations.vllm.manifest import RouteParams, StoreManifest


def test_a_dead_decode_is_marked_down_excluded_and_rejoins(
        store: tuple[Path, StoreManifest], fakes: Callable[..., Fake]) -> None:
    p, d0, d1 = fakes(), fakes(), fakes()
    # The default poll interval, 0.5 s: the instance is down well within 2 s.
    with routed(store, [p], [d0, d1], poll_interval_s=0.5) as client:
        d0.kill()
        wait_until(lambda: not stats(client)["decode"][0]["up"], timeout_s=2.0)
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        (down,) = health.json()["down"]
        assert down["url"] == d0.url and down["role"] == "decode"
        # dualpath sends an idle cluster's requests to decode 0 (ties: the lower id): none
        # goes there while it is down, none needs a retry.
        prompts = [PROMPT + str(k) for k in range(4)]
        for prompt in prompts:
            resp = complete(client, prompt)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == reply_text(prompt)
        assert len(d1.bodies("/v1/completions")) == 4
        assert {b["kv_transfer_params"]["dualpath"]["de"] for b in p.bodies(
            "/v1/completions")} == {side(1)}
        s = stats(client)
        assert s["retries"] == 0 and s["health"] == "degraded"
        assert 'dualpath_router:up{instance="' + d0.url + '"' in client.get("/metrics").text
        # It answers again (a restart on its port): it takes requests again.
        d0.start()
        wait_until(lambda: client.get("/health").json()["status"] == "ok")
        assert complete(client).status_code == 200
        assert len(d0.bodies("/v1/completions")) == 1


def test_with_its_only_decode_down_a_request_waits_for_the_restart(
        store: tuple[Path, StoreManifest], fakes: Callable[..., Fake]) -> None:
    p, d = fakes(), fakes()
    with routed(store, [p], [d]) as client, ThreadPoolExecutor(1) as pool:
        d.kill()
        wait_until(lambda: client.get("/health").status_code == 503)
        assert client.get("/health").json()["status"] == "unavailable"
        waiting = pool.submit(complete, client)
        wait_until(lambda: stats(client)["waiting"] == 1)
        d.start()
        resp = waiting.result()
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == reply_text(
            PROMPT)


def test_a_queue_timeout_names_the_instances_down(
        store: tuple[Path, StoreManifest], fakes: Callable[..., Fake]) -> None:
    p, d = fakes(), fakes()
    with routed(store, [p], [d], queue_timeout_s=0.3) as client:
        d.kill()
        wait_until(lambda: client.get("/health").status_code == 503)
        resp = complete(client)
        assert resp.status_code == 503
        assert d.url in resp.json()["error"]["message"]


@pytest.mark.parametrize("where", ["prefill", "decode", "decode-stream"])
def test_an_instance_killed_before_the_first_token_is_retried_elsewhere(
        store: tuple[Path, StoreManifest], fakes: Callable[..., Fake], where: str) -> None:
    is_stream = where == "decode-stream"
    held = fakes("prefill" if where == "prefill" else "decode")
    other = fakes()
    if where == "prefill":
        prefill, decode = [held, other], [fakes()]
    else:
        prefill, decode = [fakes()], [held, other]
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "stream": is_stream}

    def send() -> tuple[int, str, str | None]:
        with client.stream("POST", "/v1/completions", json=body,
                           headers={"X-Request-Id": "trace-7"}) as resp:
            raw = resp.read().decode()
        if is_stream:
            words = [json.loads(x[6:])["choices"][0]["delta"]["content"]
                     for x in raw.split("\n\n") if x.startswith("data: {")]
            return resp.status_code, "".join(words), resp.headers.get("x-request-id")
        return resp.status_code, json.loads(raw)["choices"][0]["text"], \
            resp.headers.get("x-request-id")

    # Both first choices (prefill 0, decode 0: the lower ids of an idle cluster) are `held`.
    with routed(store, prefill, decode) as client, ThreadPoolExecutor(1) as pool:
        sent = pool.submit(send)
        wait_until(held.is_holding)
        held.kill()
        status, text, trace = sent.result()
        assert (status, text, trace) == (200, reply_text(PROMPT), "trace-7")
        s = stats(client)
        assert s["retries"] == 1 and s["finished"] == 1 and s["aborted"] == 0
        assert not s["prefill" if where == "prefill" else "decode"][0]["up"]
    # The second placement is a new transfer on the instances alive; the decode instance
    # that answered got the second prefill's params, never the first's.
    pre = [RouteParams.from_params(b["kv_transfer_params"])
           for f in prefill for b in f.bodies("/v1/completions")]
    assert len(pre) == 2 and all(x is not None for x in pre)
    first, second = pre
    assert first is not None and second is not None
    assert first.xfer != second.xfer
    if where != "prefill":
        assert (first.de, second.de) == (side(0), side(1))
    (got,) = (decode[0] if where == "prefill" else other).bodies("/v1/completions")
    assert got["kv_transfer_params"]["dualpath"]["xfer"] == second.xfer
    traces = {r["trace"] for f in (*prefill, *decode) for r in f.records() if "path" in r
              and r["path"] != "/tokenize"}
    assert traces == {"trace-7"}


def test_a_stream_broken_after_its_first_event_ends_with_an_error_event(
        store: tuple[Path, StoreManifest], fakes: Callable[..., Fake]) -> None:
    p, d = fakes(), fakes("stream")
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "stream": True}
    with routed(store, [p], [d]) as client, \
            client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = next(x for x in lines if x)
        assert json.loads(first[6:])["choices"][0]["delta"]["content"] == \
            stream_words(PROMPT)[0]
        wait_until(d.is_holding)
        d.kill()
        rest = [x for x in lines if x]
        assert len(rest) == 2 and rest[1] == "data: [DONE]"
        error = json.loads(rest[0][6:])["error"]
        assert error["type"] == "server_error" and d.url in error["message"]
        s = stats(client)
        assert s["stream_errors"] == 1 and s["retries"] == 0 and s["aborted"] == 1


def test_the_trace_id_reaches_both_instances(
        store: tuple[Path, StoreManifest], fakes: Callable[..., Fake]) -> None:
    p, d = fakes(), fakes()
    with routed(store, [p], [d]) as client:
        resp = complete(client)
        assert resp.status_code == 200
        trace = resp.headers["x-request-id"]
        assert len(trace) == 32
        assert complete(client, **{"X-Request-Id": "mine"}).headers["x-request-id"] == "mine"
    got = [(r["path"], r["trace"]) for f in (p, d) for r in f.records()
           if r.get("path", "").startswith("/v1/")]
    assert sorted(got) == sorted([("/v1/completions", trace)] * 2
                                 + [("/v1/completions", "mine")] * 2)
