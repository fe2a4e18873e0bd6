"""A stand-in vLLM instance in a process of its own, that a test can SIGKILL mid-request.

The endpoints the router uses (`/health`, `/metrics`, `/tokenize`, `/v1/completions`,
`/v1/chat/completions`), one token per prompt character, replies that depend only on the
prompt (so a retried request must get the same text), streams in HTTP/1.1 chunks (a process
killed mid-stream leaves an incomplete chunked body, as a dying vLLM server does). Every
request received is appended to `--log` as a JSON line, and a held request logs "hold" before
it waits, so the test knows when to kill.

    python fake_instance.py --port P --log FILE [--hold prefill|decode|stream] [--recompute N]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HOLD_S = 60.0
"""How long a held request waits (the test kills the process long before)."""


def reply_text(prompt: str) -> str:
    """What this fake 'generates' for a prompt: a function of the prompt alone."""
    return "re:" + prompt[::-1][:12]


def stream_words(prompt: str) -> list[str]:
    text = reply_text(prompt)
    return [text[:4], text[4:]]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return

    def _record(self, record: dict[str, Any]) -> None:
        with self.server.lock, open(self.server.log, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def _json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {})
        elif self.path == "/metrics":
            data = b""
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", "0")
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})
        else:
            self._json(404, {"error": "no route"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        trace = self.headers.get("X-Request-Id")
        self._record({"path": self.path, "body": body, "trace": trace})
        if self.path == "/tokenize":
            text = body["prompt"] if "prompt" in body else "".join(
                m["content"] for m in body["messages"])
            self._json(200, {"tokens": [ord(c) for c in text], "count": len(text)})
            return
        prompt = body["prompt"] if "prompt" in body else "".join(
            m["content"] for m in body["messages"])
        params = (body.get("kv_transfer_params") or {}).get("dualpath")
        if params is not None and body.get("max_tokens") == 1:  # the prefill step
            self._hold("prefill")
            # What a connector reports it loaded: the plan, less the last `--recompute`
            # blocks (a failed load recomputes from that block on).
            hit, pe = params["hit_blocks"], params["pe_blocks"]
            ok = max(hit - self.server.recompute, 0)
            loads = {"pe_blocks": min(pe, ok), "de_blocks": max(ok - pe, 0),
                     "recomputed_blocks": hit - ok}
            self._json(200, {"id": "p", "choices": [{"text": "x"}], "kv_transfer_params": {
                "dualpath": {**params, "tokens": len(prompt), "loads": loads}}})
            return
        self._hold("decode")
        usage = {"prompt_tokens": len(prompt), "completion_tokens": 2,
                 "total_tokens": len(prompt) + 2,
                 "prompt_tokens_details": {"cached_tokens": len(prompt) - 1}}
        if not body.get("stream"):
            self._json(200, {"id": "d", "choices": [{"text": reply_text(prompt)}],
                             "usage": usage, "seen": body})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for k, word in enumerate(stream_words(prompt)):
            if k == 1:
                self._hold("stream")
            self._chunk(f"data: {json.dumps({'choices': [{'delta': {'content': word}}]})}\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            self._chunk(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n")
        self._chunk("data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _hold(self, where: str) -> None:
        if self.server.hold == where:
            self._record({"hold": where})
            time.sleep(HOLD_S)


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, log: str, hold: str | None, recompute: int = 0) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.log = log
        self.hold = hold
        self.recompute = recompute
        self.lock = threading.Lock()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--hold", choices=("prefill", "decode", "stream"))
    ap.add_argument("--recompute", type=int, default=0, help="report the last N hit blocks "
                    "recomputed, not loaded")
    args = ap.parse_args()
    FakeServer(args.port, args.log, args.hold, args.recompute).serve_forever()


if __name__ == "__main__":
    main()
