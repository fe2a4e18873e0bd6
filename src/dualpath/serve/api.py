"""The OpenAI-compatible HTTP API over a `ServingEngine`: FastAPI on uvicorn.

    GET  /health /version /metrics       open (the rest needs the API key when one is set)
    GET  /v1/models  /v1/models/{id}     the one served model
    GET  /stats                          requests, tokens, storage counters, the cluster's shape
    POST /v1/completions                 `prompt`: text, token ids, or a list of prompts
    POST /v1/chat/completions            `messages` in the model's own chat template
    POST /tokenize  /detokenize          vLLM's

Requests are the pydantic schemas of `protocol`; every error has OpenAI's shape
(`{"error": {"message", "type", "param", "code"}}`): 400 naming the field, 401 without the API
key, 404, 405, 408 / 413 for a body too slow or too large, 503 while the cluster cannot
serve (the key, the body's limits and the timeouts are `dualpath.http`'s, as the router's).
`usage.prompt_tokens_details.cached_tokens` counts the prompt tokens whose KV the cluster read
from storage. A stop string ends the reply and cancels the request there (the cluster ends it
at its next decode step), as does a streaming client that disconnects.

Each request waits on its `Generation` in the event loop (`achunks`), never in a thread, so
hundreds of concurrent streams cost no threads. Connections are kept alive; a client must
send a request's head within `head_timeout_s` of connecting (or of its previous response) and
its body within `body_timeout_s`, and an idle kept-alive connection is closed after
`keep_alive_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from http import HTTPStatus
from importlib.metadata import version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dualpath.core.errors import SpecError
from dualpath.http.api_error import ApiError, add_error_handlers, bad_request, server_error
from dualpath.http.exposition import metrics_response
from dualpath.http.server import HttpServer, ServerConfig
from dualpath.runtime.model.sampling import TokenLogprobs
from dualpath.runtime.model.tokenizer import ChatMessage, Tokenizer, TokenizerError
from dualpath.serve.engine import Finished, Generation, ServeError, ServingEngine
from dualpath.serve.metrics import ServeMetrics, storage_counters
from dualpath.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Limits,
    ParsedRequest,
    TokenizeRequest,
    check_model,
    finite,
    to_runtime,
    validation_error,
)

VERSION = version("dualpath")


# -- text -------------------------------------------------------------------------------------
class TextStream:
    """Token ids in, text out: decodes the whole output each time (so multi-byte characters
    split across tokens come out whole), holds back what could still become a stop string,
    and cuts the text at the first stop string (after it with `is_include_stop`)."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str], is_include_stop: bool = False,
                 is_skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.is_include_stop = is_include_stop
        self.is_skip_special_tokens = is_skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.num_sent = 0
        self.is_stopped = False
        self.num_ids_at_stop = 0
        """Token ids pushed up to the push that completed the first stop string (what
        `usage.completion_tokens` counts once stopped)."""

    def push(self, ids: Sequence[int], is_final: bool = False) -> str:
        """The text that may be sent now (empty once stopped)."""
        if self.is_stopped:
            return ""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.is_skip_special_tokens)
        cuts = [(i, len(s)) for s in self.stop if (i := text.find(s)) >= 0]
        if cuts:
            at, size = min(cuts)
            text = text[: at + size if self.is_include_stop else at]
            self.is_stopped = True
            self.num_ids_at_stop = len(self.ids)
            safe = len(text)
        elif is_final:
            safe = len(text)
        else:
            safe = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character
            hold = 0  # the longest tail that may still grow into a stop string
            for stop in self.stop:
                for k in range(min(len(stop) - 1, safe), 0, -1):
                    if text[safe - k: safe] == stop[:k]:
                        hold = max(hold, k)
                        break
            safe -= hold
        self.text = text
        out = text[self.num_sent: safe] if safe > self.num_sent else ""
        self.num_sent = max(self.num_sent, safe)
        return out


# -- one choice -------------------------------------------------------------------------------
@dataclass
class Piece:
    """What one choice adds to a reply: text, the logprobs of the tokens that made it, and
    at the end the finish reason and the choice's result."""

    index: int
    text: str
    logprobs: list[TokenLogprobs]
    finish: str | None = None
    fin: Finished | None = None
    num_completion: int = 0


async def run_choice(engine: ServingEngine, req: ParsedRequest, index: int, gen: Generation,
                     metrics: ServeMetrics) -> AsyncGenerator[Piece]:
    """The pieces of choice `index` as its tokens come (the echoed prompt first); cancels the
    request at its first stop string, and when the consumer stops early."""
    tok = engine.tokenizer
    stream = TextStream(tok, req.stop, req.is_include_stop_str, req.is_skip_special_tokens)
    try:
        if req.is_echo:
            yield Piece(index, tok.decode(req.prompts[index],
                                          skip_special_tokens=req.is_skip_special_tokens), [])
        async for ids in gen.achunks():
            start = len(stream.ids)
            text = stream.push(ids)
            lps = gen.logprobs[start:len(stream.ids)] if req.num_logprobs is not None else []
            if text or lps:
                yield Piece(index, text, lps)
            if stream.is_stopped:
                gen.cancel()
    finally:  # closed early (the client left): stop generating for nobody; else a no-op
        gen.cancel()
    fin = gen.result()
    metrics.observe(fin)
    text = stream.push((), is_final=True)
    if stream.is_stopped:  # counted up to the push that completed the stop string
        yield Piece(index, text, [], "stop", fin, min(stream.num_ids_at_stop,
                                                      len(fin.output_ids)))
    else:
        yield Piece(index, text, [], fin.finish_reason, fin, len(fin.output_ids))


async def merged(streams: Sequence[AsyncGenerator[Piece]]) -> AsyncIterator[Piece]:
    """The pieces of all choices as they come."""
    if len(streams) == 1:
        async for p in streams[0]:
            yield p
        return
    out: asyncio.Queue[Piece | BaseException | None] = asyncio.Queue()

    async def pump(s: AsyncGenerator[Piece]) -> None:
        try:
            async for p in s:
                await out.put(p)
        except BaseException as exc:  # re-raised in the consumer
            await out.put(exc)
            return
        await out.put(None)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await out.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            with contextlib.suppress(BaseException):
                await s.aclose()


# -- response objects -------------------------------------------------------------------------
TokenText = Callable[[int], str]


def completion_logprobs(name: TokenText, lps: Sequence[TokenLogprobs],
                        offset: int) -> dict[str, Any]:
    """OpenAI's legacy completion `logprobs` object; `offset`: the text before them."""
    tokens, offsets = [], []
    for lp in lps:
        offsets.append(offset)
        text = name(lp.token_id)
        tokens.append(text)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [finite(lp.logprob) for lp in lps],
            "top_logprobs": [{name(t): finite(v) for t, v in lp.top} for lp in lps],
            "text_offset": offsets}


def chat_logprobs(name: TokenText, lps: Sequence[TokenLogprobs]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = name(token_id)
        return {"token": text, "logprob": finite(logprob),
                "bytes": list(text.encode("utf-8", "replace"))}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}


def _usage(req: ParsedRequest, ends: Sequence[Piece]) -> dict[str, Any]:
    """Usage over all choices; the `n` choices of one prompt count it once (OpenAI)."""
    firsts = [p.fin for p in ends if p.fin is not None and p.index % req.n == 0]
    prompt = sum(f.prompt_tokens for f in firsts)
    completion = sum(p.num_completion for p in ends)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in firsts)}}


class _Reply:
    """Builds one request's response objects."""

    def __init__(self, engine: ServingEngine, req: ParsedRequest) -> None:
        self.engine, self.req = engine, req
        self.id = ("chatcmpl-" if req.is_chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.offsets = [0] * len(req.gens)

    def logprobs(self, piece: Piece) -> dict[str, Any] | None:
        if self.req.num_logprobs is None:
            return None
        tok = self.engine.tokenizer

        def name(token_id: int) -> str:
            return f"token_id:{token_id}" if self.req.is_token_ids else tok.decode([token_id])

        if self.req.is_chat:
            return chat_logprobs(name, piece.logprobs)
        return completion_logprobs(name, piece.logprobs, self.offsets[piece.index])

    def choice(self, piece: Piece, is_delta: bool, is_first: bool = False) -> dict[str, Any]:
        lp = self.logprobs(piece)
        self.offsets[piece.index] += len(piece.text)
        if not self.req.is_chat:
            return {"index": piece.index, "text": piece.text, "finish_reason": piece.finish,
                    "logprobs": lp}
        if is_delta:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if is_first else {}
            if piece.text:
                delta["content"] = piece.text
            return {"index": piece.index, "delta": delta, "finish_reason": piece.finish,
                    "logprobs": lp}
        return {"index": piece.index, "message": {"role": "assistant", "content": piece.text},
                "finish_reason": piece.finish, "logprobs": lp}

    def body(self, **fields: Any) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if self.req.is_client_streaming else "chat.completion") \
            if self.req.is_chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.engine.model_name, **fields}


def _submit(engine: ServingEngine, req: ParsedRequest, metrics: ServeMetrics
            ) -> list[AsyncGenerator[Piece]]:
    gens: list[Generation] = []
    try:
        for one in req.gens:
            gens.append(engine.generate(one))
    except BaseException:
        for gen in gens:
            gen.cancel()
        raise
    return [run_choice(engine, req, i, g, metrics) for i, g in enumerate(gens)]


async def complete(engine: ServingEngine, req: ParsedRequest,
                   metrics: ServeMetrics) -> dict[str, Any]:
    """Run a non-streaming request to its end; the OpenAI response object."""
    reply = _Reply(engine, req)
    texts = [""] * len(req.gens)
    lps: list[list[TokenLogprobs]] = [[] for _ in req.gens]
    ends: list[Piece] = []
    async for p in merged(_submit(engine, req, metrics)):
        texts[p.index] += p.text
        lps[p.index] += p.logprobs
        if p.fin is not None:
            ends.append(p)
    ends.sort(key=lambda p: p.index)
    choices = [reply.choice(Piece(p.index, texts[p.index], lps[p.index], p.finish),
                            is_delta=False) for p in ends]
    fins = [p.fin for p in ends if p.fin is not None]
    return reply.body(choices=choices, usage=_usage(req, ends), dualpath={
        "ttft_s": round(min(f.ttft_s for f in fins), 4),
        "total_s": round(max(f.total_s for f in fins), 4), "mode": engine.cfg.mode})


async def stream_events(engine: ServingEngine, req: ParsedRequest,
                        metrics: ServeMetrics) -> AsyncGenerator[dict[str, Any]]:
    """The chunk objects of a streaming request (each becomes one `data:` event)."""
    reply = _Reply(engine, req)
    choices = _submit(engine, req, metrics)  # errors before the first event: a JSON error
    # With include_usage every chunk has a `usage` key, null but in the last (OpenAI).
    usage: dict[str, Any] = {"usage": None} if req.include_usage else {}
    if req.is_chat:
        for i in range(len(choices)):
            yield reply.body(choices=[reply.choice(Piece(i, "", []), True, True)], **usage)
    ends = []
    async for p in merged(choices):
        if p.text or p.logprobs or p.finish:
            yield reply.body(choices=[reply.choice(p, is_delta=True)], **usage)
        if p.fin is not None:
            ends.append(p)
    if req.include_usage:
        yield reply.body(choices=[], usage=_usage(req, ends))


# -- the app ----------------------------------------------------------------------------------
def _serve_error(err: ServeError) -> ApiError:
    return server_error(HTTPStatus.SERVICE_UNAVAILABLE, str(err))


def make_app(engine: ServingEngine) -> FastAPI:
    """The FastAPI app over `engine` (unguarded: `HttpServer` adds the API key, the body
    limit and the timeouts)."""
    api = FastAPI(title="dualpath", version=VERSION, docs_url="/docs", redoc_url=None)
    limits = Limits(engine.model_name, engine.max_sequence_tokens, engine.max_prompt_tokens)
    metrics = ServeMetrics(engine)
    api.state.metrics = metrics

    add_error_handlers(api)

    @api.exception_handler(RequestValidationError)
    async def on_invalid(_r: Request, err: RequestValidationError) -> JSONResponse:
        return validation_error(err.errors()).response()

    @api.exception_handler(SpecError)
    async def on_spec(_r: Request, err: SpecError) -> JSONResponse:  # the cluster refused
        return bad_request(err.field, str(err)).response()

    @api.exception_handler(ServeError)
    async def on_serve(_r: Request, err: ServeError) -> JSONResponse:
        return _serve_error(err).response()

    @api.get("/health")
    async def health() -> JSONResponse:
        ok = engine.is_healthy
        return JSONResponse({"status": "ok" if ok else "unavailable"},
                            status_code=200 if ok else 503)

    @api.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": VERSION, "model": engine.model_name, "mode": engine.cfg.mode}

    def model_card() -> dict[str, Any]:
        return {"id": engine.model_name, "object": "model", "created": int(engine.started_at),
                "owned_by": "dualpath", "max_model_len": engine.max_sequence_tokens}

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id, limits)
        return model_card()

    @api.get("/stats")
    async def stats() -> dict[str, Any]:
        cfg, s = engine.cfg, engine.stats
        waiting, running = engine.num_in_flight()
        return {
            "model": engine.model_name, "mode": cfg.mode,
            "uptime_s": time.time() - engine.started_at,
            "cluster": {"prefill_nodes": cfg.num_prefill_nodes,
                        "decode_nodes": cfg.num_decode_nodes,
                        "engines_per_node": cfg.engines_per_node},
            "restarts": engine.num_restarts,
            "unpersisted_blocks": engine.num_unpersisted_blocks, "requests": s.num_requests,
            "finished": s.num_finished, "waiting": waiting, "running": running,
            "prompt_tokens": s.num_prompt_tokens, "cached_tokens": s.num_cached_tokens,
            "generated_tokens": s.num_generated_tokens, "storage": storage_counters(engine)}

    @api.get("/metrics")
    async def prometheus() -> Response:
        return metrics_response(metrics.registry)

    async def generate(req: ParsedRequest) -> Response:
        if not req.is_client_streaming:
            return JSONResponse(await complete(engine, req, metrics))
        events = stream_events(engine, req, metrics)
        try:
            first = await anext(events)  # submit errors become a JSON error, not a stream
        except StopAsyncIteration:
            first = None

        async def sse() -> AsyncIterator[bytes]:
            try:
                if first is not None:
                    yield b"data: " + json.dumps(first).encode() + b"\n\n"
                async for ev in events:
                    yield b"data: " + json.dumps(ev).encode() + b"\n\n"
            except ServeError as err:
                yield b"data: " + json.dumps(_serve_error(err).body()).encode() + b"\n\n"
            finally:
                await events.aclose()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        return await generate(to_runtime(body, engine.tokenizer, limits))

    @api.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> Response:
        return await generate(to_runtime(body, engine.tokenizer, limits))

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model, limits)
        tok = engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("prompt", "give either prompt or messages")
        if body.messages is not None:
            try:
                ids = tok.apply_chat_template([ChatMessage(m.role, m.text())
                                               for m in body.messages],
                                              body.add_generation_prompt)
            except TokenizerError as exc:
                raise bad_request("messages", str(exc)) from None
        else:
            assert body.prompt is not None
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_sequence_tokens}

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model, limits)
        bad = next((t for t in body.tokens if t >= engine.tokenizer.vocab_size), None)
        if bad is not None:
            raise bad_request("tokens", f"token id {bad} is outside the vocabulary "
                              f"[0, {engine.tokenizer.vocab_size})")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    return api


# -- the server -------------------------------------------------------------------------------
class ApiServer(HttpServer):
    """The API over `engine` on a bound socket; `serve_forever` runs it until `shutdown`."""

    def __init__(self, engine: ServingEngine, host: str, port: int,
                 config: ServerConfig) -> None:
        self.engine = engine
        super().__init__(make_app(engine), host, port, config)


def make_server(engine: ServingEngine, host: str = "127.0.0.1", port: int = 8000,
                is_logging: bool = True, api_key: str | None = None,
                config: ServerConfig | None = None) -> ApiServer:
    """A bound server (port 0: any free port, see `server_address`); call `serve_forever`.
    `is_logging` False: warnings only (`config.log_level`); `api_key` overrides the config's."""
    base = config or ServerConfig()
    cfg = replace(base, api_key=api_key if api_key is not None else base.api_key,
                  log_level=base.log_level if is_logging else "warning")
    return ApiServer(engine, host, port, cfg)
