"""Stand-in vLLM instances: one asyncio process serving any number of ports, each port one
instance, cheap enough for a thousand of them on a laptop's cores. The router's tests run one
per process (a test SIGKILLs it mid-request, as a crashing server would be killed); the
router's scale benchmark runs a node's worth of instances per process.

Each instance answers the endpoints the router uses (`/health`, `/metrics`, `/tokenize`,
`/v1/completions`, `/v1/chat/completions`, `/v1/models`). A text prompt is one token per
character; a reply depends only on the prompt (so a retried request gets the same text) and
names the token ids it "generated" (`token_ids`), which an agent appends to its context.
Streams go out in HTTP/1.1 chunks (a process killed mid-stream leaves an incomplete chunked
body, as a dying vLLM server does). With `--log` every request received is appended to the
file as a JSON line, and a held request logs "hold" before it waits, so a test knows when to
kill. With `--store`, the instance publishes the store's manifest as a connector does and a
decode instance saves its prompt's full files, as the decode connector persists the prompt's
KV; `--report-to` pushes the process's instances' state to a router as one node's report
(`integrations.vllm.reports`, with the router's own reporter loop).

Service times (`--prefill-ms`, `--decode-ms`) are sleeps, so one process serves any number
of requests at once. A reply's `standin_us` (in the prefill reply's `kv_transfer_params`,
then summed in the decode reply) is the time the instances held the request, from its body
read to its reply written: a client subtracts it to get the router's added latency.

    python fake_instance.py --port P [--port P2 ...] | --ports N  [--log FILE]
        [--hold prefill|decode|stream] [--recompute N] [--prefill-ms MS] [--decode-ms MS]
        [--store DIR --namespace HEX --block-size N --blocks-per-file G --model NAME]
        [--kv-blocks N] [--report-to URL --node NAME --report-interval S]

With `--ports N` it binds N free ports and prints them, one JSON list on one line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import signal
import time
from pathlib import Path
from typing import Any

HOLD_S = 60.0
"""How long a held request waits (the test kills the process long before)."""
GONE_CHECK_S = 0.05


class ClientGone(Exception):
    """The client closed the connection of a request in service: the request is dropped, as
    vLLM aborts a request whose client disconnected."""
VOCAB = 50_000


def reply_text(prompt: str | list[int]) -> str:
    """What this fake 'generates' for a prompt: a function of the prompt alone."""
    if isinstance(prompt, list):
        return "re:" + ",".join(str(t) for t in prompt[::-1][:3])
    return "re:" + prompt[::-1][:12]


def stream_words(prompt: str) -> list[str]:
    text = reply_text(prompt)
    return [text[:4], text[4:]]


def generated_ids(prompt: list[int], num_tokens: int) -> list[int]:
    """The token ids this fake 'generates' after `prompt`: a function of the prompt alone."""
    seed = hashlib.blake2b(repr((len(prompt), prompt[-8:])).encode(), digest_size=8)
    x = int.from_bytes(seed.digest(), "little")
    out = []
    for _ in range(num_tokens):
        x = (x * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append((x >> 33) % VOCAB)
    return out


def prompt_of(body: dict[str, Any]) -> str | list[int]:
    if "prompt" in body:
        prompt: str | list[int] = body["prompt"]
        return prompt
    return "".join(m["content"] for m in body["messages"])


def token_ids(prompt: str | list[int]) -> list[int]:
    return [ord(c) for c in prompt] if isinstance(prompt, str) else prompt


class Saver:
    """What a decode connector persists of a prompt: its full store files, under their keys
    (`StoreManifest.stored_key` of each file's last block), once."""

    def __init__(self, store: Path, manifest: Any) -> None:
        from dualpath.store import BlockStore
        self.manifest = manifest
        self.blocks = BlockStore(store, manifest.file_bytes, is_durable=False)
        self.saved: set[bytes] = set()
        self.payload = bytes(manifest.file_bytes)

    def save(self, tokens: list[int]) -> int:
        from dualpath.core.blocks import block_keys
        m = self.manifest
        keys = block_keys(tokens, m.block_size, m.namespace_bytes)
        g = m.blocks_per_file
        num = 0
        for key in keys[g - 1::g]:
            stored = m.stored_key(key)
            if stored not in self.saved:
                self.blocks.put(stored, self.payload)
                self.saved.add(stored)
                num += 1
        return num


class Instance:
    """One port's instance: its requests in flight and its counters."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.running = 0
        self.num_requests = 0
        self.num_dropped = 0
        """Requests whose client left while they were in service."""
        self.decode_tokens = 0
        """Prompt tokens of the decode requests in flight (what their KV holds)."""


class Fleet:
    """The instances of this process and what they share: the options, the log, the saver."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.log = args.log
        self.saver: Saver | None = None
        if args.store:
            from dualpath.integrations.vllm.manifest import StoreManifest
            manifest = StoreManifest(namespace=args.namespace, model=args.model,
                                     block_size=args.block_size,
                                     full_block_bytes=args.block_bytes,
                                     blocks_per_file=args.blocks_per_file)
            manifest.write(args.store)
            self.saver = Saver(Path(args.store), manifest)
        self.instances: dict[int, Instance] = {}
        self.servers: list[asyncio.Server] = []
        self.tasks: list[asyncio.Task[None]] = []

    def record(self, record: dict[str, Any]) -> None:
        if self.log:
            with open(self.log, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    async def hold(self, where: str, inst: Instance, reader: asyncio.StreamReader) -> None:
        if self.args.hold == where:
            self.record({"hold": where, "port": inst.port})
            await self.serve_for(HOLD_S, inst, reader)

    async def serve_for(self, seconds: float, inst: Instance,
                        reader: asyncio.StreamReader) -> None:
        """Spend `seconds` on a request, unless its client leaves first (`ClientGone`)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if reader.at_eof():
                inst.num_dropped += 1
                raise ClientGone
            await asyncio.sleep(min(left, GONE_CHECK_S))

    def metrics_page(self, inst: Instance) -> bytes:
        kv_blocks = self.args.kv_blocks
        if not kv_blocks:
            return b""
        bs = self.args.block_size
        usage = min(1.0, inst.decode_tokens / (kv_blocks * bs))
        return (f"# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{engine="0",model_name="m"}} {inst.running}.0\n'
                f'vllm:num_requests_waiting{{engine="0",model_name="m"}} 0.0\n'
                f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {usage}\n'
                f'vllm:cache_config_info{{block_size="{bs}",engine="0",'
                f'num_gpu_blocks="{kv_blocks}"}} 1.0\n').encode()

    async def state_of(self, url: str) -> Any:
        """An instance's state as its node's report gives it (`reports.EngineState`)."""
        from dualpath.integrations.vllm.reports import EngineState
        inst = self.instances[int(url.rsplit(":", 1)[1])]
        kv_blocks, bs = self.args.kv_blocks, self.args.block_size
        usage = min(1.0, inst.decode_tokens / (kv_blocks * bs)) if kv_blocks else None
        return EngineState(url, True, inst.running, 0, usage,
                           kv_blocks * bs if kv_blocks else None)

    # -- HTTP ------------------------------------------------------------------------------
    async def serve(self, port: int) -> int:
        """Listen on `port` (0: a free one) as one instance; returns the port."""
        server = await asyncio.start_server(
            lambda r, w: self.connection(r, w, inst), "127.0.0.1", port, reuse_address=True,
            backlog=1024)
        bound = server.sockets[0].getsockname()[1]
        inst = Instance(bound)
        self.instances[bound] = inst
        self.servers.append(server)
        return int(bound)

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         inst: Instance) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError,
                                 asyncio.LimitOverrunError, asyncio.CancelledError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *lines = head.decode("latin-1").split("\r\n")
                method, path, _ = line.split(" ", 2)
                headers = {}
                for x in lines:
                    if x:
                        k, _, v = x.partition(":")
                        headers[k.strip().lower()] = v.strip()
                length = int(headers.get("content-length", "0"))
                data = await reader.readexactly(length) if length else b""
                try:
                    await self.handle(inst, method, path, headers, data, reader, writer)
                except ClientGone:
                    break
        writer.close()

    @staticmethod
    def reply(writer: asyncio.StreamWriter, status: int, body: Any,
              content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        reason = {200: "OK", 404: "Not Found"}.get(status, "")
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)

    async def handle(self, inst: Instance, method: str, path: str, headers: dict[str, str],
                     data: bytes, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        if method == "GET":
            if path == "/health":
                self.reply(writer, 200, {})
            elif path == "/metrics":
                self.reply(writer, 200, self.metrics_page(inst), "text/plain")
            elif path == "/v1/models":
                self.reply(writer, 200, {"object": "list", "data": [
                    {"id": "m", "object": "model"},
                    {"id": "ad", "object": "model", "root": "/lora/ad", "parent": "m"}]})
            else:
                self.reply(writer, 404, {"error": "no route"})
            return
        began = time.perf_counter()
        body = json.loads(data)
        self.record({"path": path, "body": body, "trace": headers.get("x-request-id"),
                     "port": inst.port})
        prompt = prompt_of(body)
        if path == "/tokenize":
            text = prompt if isinstance(prompt, str) else ""
            self.reply(writer, 200, {"tokens": [ord(c) for c in text], "count": len(text)})
            return
        params = (body.get("kv_transfer_params") or {}).get("dualpath")
        inst.num_requests += 1
        inst.running += 1
        try:
            if params is not None and body.get("max_tokens") == 1:  # the prefill step
                await self.prefill(inst, body, params, prompt, began, reader, writer)
            else:
                await self.decode(inst, body, params, prompt, began, reader, writer)
        finally:
            inst.running -= 1

    async def prefill(self, inst: Instance, body: dict[str, Any], params: dict[str, Any],
                      prompt: str | list[int], began: float, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        await self.hold("prefill", inst, reader)
        await self.serve_for(self.args.prefill_ms / 1e3, inst, reader)
        # What a connector reports it loaded: the plan, less the last `--recompute` blocks
        # (a failed load recomputes from that block on).
        hit, pe = params["hit_blocks"], params["pe_blocks"]
        ok = max(hit - self.args.recompute, 0)
        loads = {"pe_blocks": min(pe, ok), "de_blocks": max(ok - pe, 0),
                 "recomputed_blocks": hit - ok}
        held_us = (time.perf_counter() - began) * 1e6
        self.reply(writer, 200, {"id": "p", "choices": [{"text": "x"}], "kv_transfer_params": {
            "dualpath": {**params, "tokens": len(prompt), "loads": loads,
                         "standin_us": held_us}}})

    async def decode(self, inst: Instance, body: dict[str, Any], params: dict[str, Any] | None,
                     prompt: str | list[int], began: float, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        ids = token_ids(prompt)
        inst.decode_tokens += len(ids)
        try:
            await self.hold("decode", inst, reader)
            await self.serve_for(self.args.decode_ms / 1e3, inst, reader)
            num_gen = body.get("max_tokens") or 2
            gen = generated_ids(ids, num_gen) if isinstance(prompt, list) else []
            if self.saver is not None and isinstance(prompt, list):
                self.saver.save(ids + gen)
        finally:
            inst.decode_tokens -= len(ids)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": 2,
                 "total_tokens": len(prompt) + 2,
                 "prompt_tokens_details": {"cached_tokens": len(prompt) - 1}}
        if not body.get("stream"):
            reply: dict[str, Any] = {"id": "d", "choices": [{"text": reply_text(prompt)}],
                                     "usage": usage}
            if gen:
                reply["choices"][0]["token_ids"] = gen
                prefill_us = (params or {}).get("standin_us", 0.0)
                reply["standin_us"] = prefill_us + (time.perf_counter() - began) * 1e6
            else:
                reply["seen"] = body
            self.reply(writer, 200, reply)
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        for k, word in enumerate(stream_words(prompt if isinstance(prompt, str) else "")):
            if k == 1:
                await self.hold("stream", inst, reader)
            await self.chunk(writer, "data: " + json.dumps(
                {"choices": [{"delta": {"content": word}}]}) + "\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            await self.chunk(writer, f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n")
        await self.chunk(writer, "data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")

    @staticmethod
    async def chunk(writer: asyncio.StreamWriter, text: str) -> None:
        data = text.encode()
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ports = ap.add_mutually_exclusive_group(required=True)
    ports.add_argument("--port", type=int, action="append", help="serve an instance on it")
    ports.add_argument("--ports", type=int, help="serve N instances on free ports")
    ap.add_argument("--log", help="append every request received to this file")
    ap.add_argument("--hold", choices=("prefill", "decode", "stream"))
    ap.add_argument("--recompute", type=int, default=0, help="report the last N hit blocks "
                    "recomputed, not loaded")
    ap.add_argument("--prefill-ms", type=float, default=0.0)
    ap.add_argument("--decode-ms", type=float, default=0.0)
    ap.add_argument("--store", help="the block store: publish its manifest, save prompts")
    ap.add_argument("--namespace", default="ab" * 16)
    ap.add_argument("--model", default="m")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--block-bytes", type=int, default=64)
    ap.add_argument("--blocks-per-file", type=int, default=1)
    ap.add_argument("--kv-blocks", type=int, default=0, help="KV capacity shown on /metrics "
                    "(0: none shown)")
    ap.add_argument("--report-to", metavar="URL", help="push this node's state to a router")
    ap.add_argument("--node", default="node", help="this node's name in its reports")
    ap.add_argument("--node-size", type=int, default=0, help="report the ports as nodes of "
                    "this many, named NODE-0, NODE-1, ... (0: one node of all)")
    ap.add_argument("--report-interval", type=float, default=0.5)
    return ap.parse_args(argv)


async def run(args: argparse.Namespace) -> None:
    fleet = Fleet(args)
    ports = [await fleet.serve(p) for p in (args.port or [0] * args.ports)]
    if args.ports:
        print(json.dumps(ports), flush=True)
    if args.report_to:
        from dualpath.integrations.vllm.router.reporter import report_forever
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        size = args.node_size or len(urls)
        for k in range(0, len(urls), size):
            node = args.node if size == len(urls) else f"{args.node}-{k // size}"
            reporting = asyncio.create_task(report_forever(
                args.report_to, node, urls[k:k + size], fleet.state_of, args.report_interval))
            reporting.add_done_callback(lambda t: t.cancelled() or t.result())
            fleet.tasks.append(reporting)  # held: the loop keeps only weak references
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def main() -> None:
    asyncio.run(run(parse_args()))


if __name__ == "__main__":
    main()
