"""OpenAI-compatible HTTP API over a `ServingEngine` (standard library `http.server`).

Endpoints:

    GET  /health               200 while the cluster serves, 503 once it failed
    GET  /v1/models            the one served model
    GET  /stats                requests, prompt / cached / generated tokens, the cluster's shape
    POST /v1/completions       `prompt` (text or token ids), OpenAI's completion objects
    POST /v1/chat/completions  `messages` in the model's own chat template (ChatML without one)

Both POST endpoints take `max_tokens` (chat also `max_completion_tokens`), `temperature`,
`top_p`, `seed`, `stop` (up to 4 strings), `stream` with `stream_options.include_usage`, and
vLLM's `ignore_eos`. `usage.prompt_tokens_details.cached_tokens` counts the prompt tokens whose
KV the cluster read from storage (whole blocks of an earlier request's prompt or output) instead
of computing them. The reply ends at the first stop string, and the request is
cancelled there (the cluster ends it at its next decode step), as is the request of a streaming
client that disconnects. `n > 1`, `logprobs`, `echo`, penalties and tools are
refused with a 400 naming the field, like every invalid value; errors use OpenAI's
`{"error": {"message", "type", "param", "code"}}` shape.
"""

from __future__ import annotations

import json
import math
import sys
import time
import uuid
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from dualpath.core.errors import DualPathError, SpecError
from dualpath.runtime.tokenizer import ChatMessage, Tokenizer, TokenizerError
from dualpath.serve.engine import Finished, GenerateRequest, ServeError, ServingEngine

MAX_BODY_BYTES = 16 * 2**20
COMPLETION_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for `/v1/completions`."""
CHAT_DEFAULT_MAX_TOKENS = 512
"""Chat's default: this, or what the sequence limit leaves after the prompt if less."""
MAX_STOP_STRINGS = 4
GREEDY_BELOW = 1e-5
"""A `temperature` below this samples greedily."""
ROLES = ("system", "user", "assistant", "tool", "developer")
UNSUPPORTED_TRUTHY = ("logprobs", "top_logprobs", "echo", "tools", "functions", "suffix",
                      "best_of", "logit_bias", "response_format")


class ApiError(DualPathError):
    """An HTTP error in OpenAI's shape; `param` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def _bad(param: str, why: str) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, f"{param}: {why}", param)


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the served cluster."""

    model_name: str
    max_sequence_tokens: int
    max_prompt_tokens: int


@dataclass(frozen=True)
class ParsedRequest:
    gen: GenerateRequest
    """`gen.is_streaming` is also set for stop strings: the server watches the tokens as they
    come and cancels the request at the first stop string."""
    stop: tuple[str, ...]
    is_chat: bool
    include_usage: bool
    is_client_streaming: bool
    """The client asked for server-sent events (`stream`)."""


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float,
            lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise _bad(name, f"must be a finite number, got {json.dumps(v)}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise _bad(name, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}")
    return float(v)


def _temperature(body: dict[str, Any]) -> float:
    """`temperature` in [0, 2]; below `GREEDY_BELOW` it is greedy (0), as dividing logits
    by a denormal would overflow them."""
    t = _number(body, "temperature", 1.0, 0.0, 2.0)
    return 0.0 if t < GREEDY_BELOW else t


def _int(body: dict[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"must be an integer, got {json.dumps(v)}")
    return int(v)


def _bool(body: dict[str, Any], name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(name, f"must be true or false, got {json.dumps(v)}")
    return v


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)
            or len(stops) > MAX_STOP_STRINGS):
        raise _bad("stop", f"must be a non-empty string or a list of up to {MAX_STOP_STRINGS}")
    return tuple(stops)


def _messages(body: dict[str, Any]) -> list[ChatMessage]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, "must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role", f"must be one of {', '.join(ROLES)}, got "
                                        f"{json.dumps(role)}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise _bad(f"{where}.content[{j}]", "only {type: text, text} parts are "
                                                        "supported")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise _bad(f"{where}.content", "must be a string or a list of text parts")
        out.append(ChatMessage(str(role), content))
    return out


def _prompt(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    v = body.get("prompt")
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str | list):
        v = v[0]  # a batch of one
    if isinstance(v, str):
        ids = tokenizer.encode(v)
    elif isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in v):
        ids = list(v)
    else:
        raise _bad("prompt", "must be a string or a list of token ids (one prompt per request)")
    if not ids:
        raise _bad("prompt", "is empty")
    return ids


def parse_request(body: Any, tokenizer: Tokenizer, limits: Limits,
                  is_chat: bool) -> ParsedRequest:
    """A validated request; ApiError (400, or 404 for another model) naming the field."""
    if not isinstance(body, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != limits.model_name:
        raise ApiError(HTTPStatus.NOT_FOUND, f"model {json.dumps(model)} does not exist; this "
                       f"server serves {json.dumps(limits.model_name)}", "model",
                       code="model_not_found")
    n = _int(body, "n")
    if n not in (None, 1):
        raise _bad("n", "only n=1 is supported")
    for name in UNSUPPORTED_TRUTHY:
        if body.get(name):
            raise _bad(name, "is not supported by this server")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise _bad(name, "only 0 is supported")
    if is_chat:
        try:
            prompt = tokenizer.apply_chat_template(_messages(body))
        except TokenizerError as exc:  # the template refused the conversation
            raise _bad("messages", str(exc)) from None
    else:
        prompt = _prompt(body, tokenizer)
    if len(prompt) > limits.max_prompt_tokens:
        raise _bad("messages" if is_chat else "prompt",
                   f"{len(prompt)} tokens; at most {limits.max_prompt_tokens} are served")
    room = limits.max_sequence_tokens - len(prompt)
    if room < 1:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"the prompt's {len(prompt)} tokens leave no "
                       f"room in the {limits.max_sequence_tokens}-token sequence limit",
                       "messages" if is_chat else "prompt", code="context_length_exceeded")
    max_tokens = _int(body, "max_completion_tokens") if is_chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens")
    if max_tokens is None:
        max_tokens = min(room, CHAT_DEFAULT_MAX_TOKENS if is_chat
                         else COMPLETION_DEFAULT_MAX_TOKENS)
    name = "max_completion_tokens" if is_chat and "max_completion_tokens" in body \
        else "max_tokens"
    if max_tokens < 1:
        raise _bad(name, f"must be >= 1, got {max_tokens}")
    if max_tokens > room:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{name}: prompt ({len(prompt)} tokens) + "
                       f"{max_tokens} exceeds the {limits.max_sequence_tokens}-token sequence "
                       "limit", name, code="context_length_exceeded")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "must be an object")
    if options is not None and not _bool(body, "stream"):
        raise _bad("stream_options", "is only allowed with stream: true")
    stream, stop = _bool(body, "stream"), _stop(body)
    gen = GenerateRequest(
        prompt_ids=tuple(prompt),
        max_tokens=max_tokens,
        temperature=_temperature(body),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        seed=_int(body, "seed"),
        is_streaming=stream or bool(stop),
        is_ignore_eos=_bool(body, "ignore_eos"),
    )
    return ParsedRequest(gen, stop, is_chat, _bool(options or {}, "include_usage"), stream)


class TextStream:
    """Token ids in, text out: decodes the whole output each time (so multi-byte characters
    split across tokens come out whole), holds back what could still become a stop string,
    and cuts the text at the first stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
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
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if cuts:
            text = text[: min(cuts)]
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


def _num_completion(fin: Finished, stream: TextStream) -> int:
    """Generated tokens up to the stop string when one ended the reply, else all of them."""
    if stream.is_stopped:
        return min(stream.num_ids_at_stop, len(fin.output_ids))
    return len(fin.output_ids)


def _usage(fin: Finished, num_completion: int) -> dict[str, Any]:
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": num_completion,
            "total_tokens": fin.prompt_tokens + num_completion,
            "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}


def _choice(req: ParsedRequest, text: str | None, finish: str | None,
            is_delta: bool, is_first: bool = False) -> dict[str, Any]:
    if not req.is_chat:
        return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    if is_delta:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if is_first else {}
        if text:
            delta["content"] = text
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    return {"index": 0, "message": {"role": "assistant", "content": text or ""},
            "finish_reason": finish, "logprobs": None}


def complete(engine: ServingEngine, req: ParsedRequest) -> dict[str, Any]:
    """Run a non-streaming request to its end (or to its first stop string, where it is
    cancelled); the OpenAI response object."""
    gen = engine.generate(req.gen)
    stream = TextStream(engine.tokenizer, req.stop)
    for ids in gen.chunks():
        stream.push(ids)
        if stream.is_stopped:
            gen.cancel()
    fin = gen.result()
    stream.push((), is_final=True)
    finish = "stop" if stream.is_stopped else fin.finish_reason
    return {
        "id": _new_id(req), "object": "chat.completion" if req.is_chat else "text_completion",
        "created": int(time.time()), "model": engine.model_name,
        "choices": [_choice(req, stream.text, finish, is_delta=False)],
        "usage": _usage(fin, _num_completion(fin, stream)),
        "dualpath": {"ttft_s": round(fin.ttft_s, 4), "total_s": round(fin.total_s, 4),
                     "mode": engine.cfg.mode},
    }


def stream_events(engine: ServingEngine, req: ParsedRequest) -> Generator[dict[str, Any]]:
    """The chunk objects of a streaming request (each becomes one `data:` event)."""
    gen = engine.generate(req.gen)
    rid, created = _new_id(req), int(time.time())
    kind = "chat.completion.chunk" if req.is_chat else "text_completion"

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        # With include_usage every chunk has a `usage` key, null but in the last (OpenAI).
        usage: dict[str, Any] = {"usage": None} if req.include_usage else {}
        return {"id": rid, "object": kind, "created": created, "model": engine.model_name,
                "choices": choices, **usage, **extra}

    stream = TextStream(engine.tokenizer, req.stop)
    try:
        if req.is_chat:
            yield chunk([_choice(req, "", None, is_delta=True, is_first=True)])
        for ids in gen.chunks():
            text = stream.push(ids)
            if text:
                yield chunk([_choice(req, text, None, is_delta=True)])
            if stream.is_stopped:
                gen.cancel()
    finally:  # closed early (the client left): stop generating for nobody; else a no-op
        gen.cancel()
    fin = gen.result()
    text = stream.push((), is_final=True)
    finish = "stop" if stream.is_stopped else fin.finish_reason
    yield chunk([_choice(req, text, finish, is_delta=True)])
    if req.include_usage:
        yield chunk([], usage=_usage(fin, _num_completion(fin, stream)))


def _new_id(req: ParsedRequest) -> str:
    return ("chatcmpl-" if req.is_chat else "cmpl-") + uuid.uuid4().hex[:24]


class ApiServer(ThreadingHTTPServer):
    """One thread per connection; every request goes to `engine`."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], engine: ServingEngine,
                 is_logging: bool = True) -> None:
        self.engine = engine
        self.is_logging = is_logging
        self.limits = Limits(engine.model_name, engine.max_sequence_tokens,
                             engine.max_prompt_tokens)
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: ApiServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.is_logging:
            sys.stderr.write(f"dualpath serve: {self.address_string()} {format % args}\n")

    def _json(self, status: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        eng = self.server.engine
        if self.path == "/health":
            ok = eng.is_healthy
            self._json(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE,
                       {"status": "ok" if ok else "unavailable"})
        elif self.path == "/v1/models":
            self._json(HTTPStatus.OK, {"object": "list", "data": [{
                "id": eng.model_name, "object": "model", "created": int(eng.started_at),
                "owned_by": "dualpath", "max_model_len": eng.max_sequence_tokens}]})
        elif self.path == "/stats":
            cfg, s = eng.cfg, eng.stats
            self._json(HTTPStatus.OK, {
                "model": eng.model_name, "mode": cfg.mode, "uptime_s": time.time() - eng.started_at,
                "cluster": {"prefill_nodes": cfg.num_prefill_nodes,
                            "decode_nodes": cfg.num_decode_nodes,
                            "engines_per_node": cfg.engines_per_node},
                "restarts": eng.num_restarts, "unpersisted_blocks": eng.num_unpersisted_blocks,
                "requests": s.num_requests, "finished": s.num_finished,
                "prompt_tokens": s.num_prompt_tokens, "cached_tokens": s.num_cached_tokens,
                "generated_tokens": s.num_generated_tokens})
        else:
            self._error(ApiError(HTTPStatus.NOT_FOUND, f"no route GET {self.path}"))

    def do_POST(self) -> None:
        self._is_body_read = False
        self._is_stream_open = False
        routes = {"/v1/completions": False, "/v1/chat/completions": True}
        try:
            if self.path not in routes:
                raise ApiError(HTTPStatus.NOT_FOUND, f"no route POST {self.path}")
            req = parse_request(self._body(), self.server.engine.tokenizer, self.server.limits,
                                is_chat=routes[self.path])
            if req.is_client_streaming:
                self._stream(req)
            else:
                self._json(HTTPStatus.OK, complete(self.server.engine, req))
        except ApiError as err:
            self._error(err)
        except SpecError as err:  # the cluster refused a field
            self._error(ApiError(HTTPStatus.BAD_REQUEST, str(err), err.field))
        except ServeError as err:
            self._error(ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(err), kind="server_error"))
        except Exception as exc:  # a bug: answer it rather than drop the connection
            self.log_error("internal error: %r", exc)
            if not self._is_stream_open:
                self._error(ApiError(HTTPStatus.INTERNAL_SERVER_ERROR,
                                     f"internal error: {type(exc).__name__}: {exc}",
                                     kind="server_error"))
            self.close_connection = True

    def _error(self, err: ApiError) -> None:
        if not getattr(self, "_is_body_read", True):
            self.close_connection = True  # its unread body must not be parsed as a request
        self._json(err.status, err.body())

    def _body(self) -> Any:
        try:
            size = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            size = -1
        if size < 0:
            raise ApiError(HTTPStatus.BAD_REQUEST, "bad Content-Length header")
        if size > MAX_BODY_BYTES:
            raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                           f"request body of {size} bytes; at most {MAX_BODY_BYTES}")
        raw = self.rfile.read(size)
        self._is_body_read = True
        try:
            return json.loads(raw or b"null")
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, huge ints
            raise ApiError(HTTPStatus.BAD_REQUEST,
                           f"invalid JSON body: {str(exc)[:200]}") from None

    def _stream(self, req: ParsedRequest) -> None:
        events = stream_events(self.server.engine, req)
        first = next(events)  # submit errors become a JSON error, not a broken stream
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        self._is_stream_open = True
        try:
            self._event(first)
            for ev in events:
                self._event(ev)
        except ServeError as err:
            self._event(ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(err),
                                 kind="server_error").body())
        except (BrokenPipeError, ConnectionResetError):
            events.close()  # the client left: its request is cancelled
            return
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, obj: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()


def make_server(engine: ServingEngine, host: str = "127.0.0.1", port: int = 8000,
                is_logging: bool = True) -> ApiServer:
    """A bound server (port 0: any free port, see `server_address`); call `serve_forever`."""
    return ApiServer((host, port), engine, is_logging)
