"""The kill test with real vLLM servers: a decode, then (separately) a prefill vLLM
server SIGKILLed under load behind `dualpath route`, with `VllmCluster.supervise` restarting
it as `dualpath vllm up` does.

`failover_phase(cluster, store, model, prompts)` runs on a started 1P1D (or larger) cluster:

1. a router (`dualpath` mode, polls every 0.5 s, a queue timeout that covers a restart);
2. the reference: each prompt alone through the router (greedy), token ids;
3. per victim (decode0, then prefill0): one prompt streamed; once its first event is in, the
   others sent at once and, 0.2 s later (at the prefill instance), the victim's vLLM API
   server process SIGKILLed (the server alone, its engine and
   workers left to the launcher); every request not yet streaming must succeed with the
   reference's tokens (retried, they wait in the router while the only instance of its role
   restarts); the stream, already going, may end with an error event;
4. the victim back in service: reported by the supervisor, `/health` ok, one more request on
   it with the reference's tokens; nothing of the killed server left (its process group
   empty, its tagged shared memory gone).

Before the kills, what the replies and vLLM's own telemetry say:
each reference reply's `usage.prompt_tokens_details.cached_tokens` equals the blocks its
prefill loaded (the `dualpath` extension), a request's `X-Request-Id` is in both instances'
logs, the decode instance's KV events (a ZMQ subscriber) carry `BlockStored` with
`medium="STORAGE"`, and the instances' `/metrics` show `vllm:dualpath_loaded_blocks_total`
and `vllm:dualpath_saved_blocks_total` (the cluster started with `kv_events`).

`vllm_pd_failover.py` runs it on a 1P1D cluster of its own, `vllm_pd_demo.py --failover` on the
demo's cluster (the P/D test does).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dualpath.integrations.vllm.cluster import reaper
from dualpath.integrations.vllm.cluster.launch import Instance, VllmCluster
from dualpath.integrations.vllm.manifest import find_manifest
from pd_kit.router import router as route_process

MAX_TOKENS = 16
NUM_PROMPTS = 4
KILL_AFTER_S = 0.2
"""From sending the requests to the kill: they are then at the prefill instance."""
WAIT_S = 600.0


def _post(url: str, body: dict[str, Any], timeout_s: float = WAIT_S,
          headers: dict[str, str] | None = None) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _body(model: str, prompt: list[int], stream: bool = False) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "return_token_ids": True, "stream": stream}


def complete(router: str, model: str, prompt: list[int],
             headers: dict[str, str] | None = None) -> dict[str, Any]:
    """One request, not streamed: its status, token ids and usage (or the error)."""
    try:
        reply = _post(router + "/v1/completions", _body(model, prompt), headers=headers)
        return {"ok": True, "tokens": list(reply["choices"][0].get("token_ids") or []),
                "text": reply["choices"][0]["text"], "usage": reply.get("usage") or {}}
    except urllib.error.HTTPError as e:
        return {"ok": False, "error": f"HTTP {e.code}: {e.read()[:300]!r}"}
    except OSError as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def stream(router: str, model: str, prompt: list[int], first: threading.Event
           ) -> dict[str, Any]:
    """One streamed request: its text, whether an event came before `first` was set by us
    (then it was already streaming), and an error event if one came."""
    req = urllib.request.Request(router + "/v1/completions",
                                 json.dumps(_body(model, prompt, True)).encode(),
                                 {"Content-Type": "application/json"})
    text, error, was_streaming = "", None, False
    try:
        with urllib.request.urlopen(req, timeout=WAIT_S) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["message"]
                    continue
                if not first.is_set():
                    was_streaming = True
                    first.set()
                text += event["choices"][0].get("text") or ""
    except (urllib.error.HTTPError, OSError) as e:
        error = f"{type(e).__name__}: {e}"
    return {"ok": error is None, "text": text, "error": error,
            "was_streaming": was_streaming}


class EventTap:
    """vLLM's KV events of one instance: a ZMQ subscriber in a thread (the instance was
    started with `VllmClusterSpec.kv_events`)."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.events: list[Any] = []
        self._stop = threading.Event()
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.connect(endpoint)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

        def run() -> None:
            while not self._stop.is_set():
                try:
                    parts = self._sock.recv_multipart()
                except zmq.Again:
                    continue
                self.events.extend(decoder.decode(parts[-1]).events)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stored(self, medium: str = "STORAGE") -> int:
        """Blocks announced stored on `medium` so far."""
        return sum(len(e.block_hashes) for e in list(self.events)
                   if type(e).__name__ == "BlockStored" and e.medium == medium)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples on an instance's `/metrics` whose labels include
    `labels` (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def usage_of(reply: dict[str, Any]) -> dict[str, Any]:
    """A reply's `cached_tokens` and its `dualpath` usage extension, flat."""
    usage = reply.get("usage") or {}
    return {"cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            **(usage.get("dualpath") or {})}


def kill_under_load(cluster: VllmCluster, victim: Instance, router: str, model: str,
                    prompts: list[list[int]], ref: list[dict[str, Any]],
                    reports: list[str]) -> dict[str, Any]:
    """The last prompt streamed; once its first event is in, the others sent at once and the
    victim's API server SIGKILLed while they are at the prefill instance (or queued for it);
    every result, and the restart."""
    first = threading.Event()
    old_group = victim.process.pid
    with ThreadPoolExecutor(len(prompts)) as pool:
        streamed = pool.submit(stream, router, model, prompts[-1], first)
        first.wait(WAIT_S)
        calls: list[Future[dict[str, Any]]] = [
            pool.submit(complete, router, model, p) for p in prompts[:-1]]
        calls.append(streamed)
        time.sleep(KILL_AFTER_S)
        pid = victim.server_pid()
        assert pid is not None, f"{victim.name}: no server process"
        t_kill = time.perf_counter()
        num_reports = len(reports)
        os.kill(pid, signal.SIGKILL)
        results = [c.result() for c in calls]
    t_done = time.perf_counter()
    deadline = time.monotonic() + WAIT_S
    while not any(f"{victim.name} is back" in r for r in reports[num_reports:]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{victim.name} did not come back: {reports}")
        time.sleep(0.5)
    back_s = time.perf_counter() - t_kill
    while _get(router + "/health")[1].get("status") != "ok":
        if time.monotonic() > deadline:
            raise RuntimeError("the router never saw the victim back")
        time.sleep(0.2)
    after = complete(router, model, prompts[0])
    not_streaming = [i for i, r in enumerate(results)
                     if i < len(prompts) - 1 or not r.get("was_streaming")]
    same = [results[i]["ok"] and (
        results[i].get("tokens") == ref[i]["tokens"] if i < len(prompts) - 1
        else results[i]["text"] == ref[i]["text"]) for i in not_streaming]
    return {
        "victim": victim.name, "killed_pid": pid,
        "requests_not_yet_streaming": len(not_streaming),
        "failed_not_yet_streaming": sum(not results[i]["ok"] for i in not_streaming),
        "identical_not_yet_streaming": sum(same),
        "stream_was_streaming": bool(results[-1].get("was_streaming")),
        "stream_error": results[-1].get("error"),
        "errors": [r.get("error") for r in results if not r["ok"]],
        "requests_done_s": round(t_done - t_kill, 1), "back_after_s": round(back_s, 1),
        "after_restart_identical": after["ok"] and after["tokens"] == ref[0]["tokens"],
        "old_group_left": reaper.group_members(old_group),
        "reports": reports[num_reports:],
    }


def failover_phase(cluster: VllmCluster, store: Path, model: str,
                   prompts: list[list[int]]) -> dict[str, Any]:
    """Steps 1-4 of the module docstring, behind a `dualpath route` of its own."""
    reports: list[str] = []
    out: dict[str, Any] = {"block_size": find_manifest(store).block_size}
    cluster.supervise(lambda line: (reports.append(line),
                                    print(f"== supervisor: {line}", file=sys.stderr)),
                      restart=True)
    taps = {i.name: EventTap(i.kv_events) for i in cluster.instances if i.kv_events}
    with route_process(cluster, store, "--mode", "dualpath", "--poll-interval", "0.5",
                   "--queue-timeout", str(int(WAIT_S))) as router:
        ref = [complete(router, model, p) for p in prompts]
        out["reference_ok"] = all(r["ok"] for r in ref)
        out["reference_usage"] = [usage_of(r) for r in ref]
        # One trace id per request, in both instances' logs (their connectors log the
        # request ids vLLM builds from it).
        trace = f"dptrace{uuid.uuid4().hex[:12]}"
        complete(router, model, prompts[0], {"X-Request-Id": trace})
        out["trace_in_logs"] = {i.name: trace in i.log_path.read_text(errors="replace")
                                for i in cluster.instances}
        # vLLM's own telemetry: the connector's metrics on each instance's /metrics, its
        # STORAGE events through vLLM's KV event publisher (the decode instance persists).
        p, d = cluster.prefill[0], cluster.decode[0]
        deadline = time.monotonic() + 30
        while taps and not taps[d.name].stored() and time.monotonic() < deadline:
            time.sleep(0.2)
        out["telemetry"] = {
            "storage_blocks_stored_events": {n: t.stored() for n, t in taps.items()},
            "prefill_loaded_blocks_pe": metric_sum(p.url, "vllm:dualpath_loaded_blocks_total",
                                                   read_path="pe"),
            "decode_saved_blocks": metric_sum(d.url, "vllm:dualpath_saved_blocks_total"),
            "prefill_read_queue_gauge": metric_sum(p.url, "vllm:dualpath_read_queue_blocks"),
        }
        for victim in (cluster.decode[0], cluster.prefill[0]):
            t = time.perf_counter()
            out[victim.name] = kill_under_load(cluster, victim, router, model, prompts, ref,
                                               reports)
            out[victim.name]["phase_s"] = round(time.perf_counter() - t, 1)
            print(f"== killed {victim.name}: {json.dumps(out[victim.name])}", file=sys.stderr)
        out["router_stats"] = {k: v for k, v in _get(router + "/stats")[1].items()
                               if k in ("retries", "stream_errors", "finished", "aborted",
                                        "queue_timeouts", "health")}
    for tap in taps.values():
        tap.close()
    return out


def checks(result: dict[str, Any]) -> dict[str, bool]:
    """The kill test's pass conditions, one per line."""
    out = {"failover: reference requests ok": bool(result.get("reference_ok"))}
    usage = result.get("reference_usage") or []
    out["usage: cached_tokens = the blocks the prefill connector loaded, none recomputed"] = (
        bool(usage) and all(
            u.get("cached_tokens") is not None and u.get("recomputed_blocks") == 0
            and u["cached_tokens"] == (u["pe_blocks"] + u["de_blocks"]) * result["block_size"]
            for u in usage) and any(u["cached_tokens"] > 0 for u in usage))
    out["usage: read bytes per side and the path in every reply"] = bool(usage) and all(
        u.get("path") in ("pe", "de", "split", "none") and set(
            u.get("read_bytes_by_side") or {}) == {"pe", "de"} for u in usage)
    out["trace id in both instances' logs"] = bool(result.get("trace_in_logs")) and all(
        result["trace_in_logs"].values())
    telemetry = result.get("telemetry") or {}
    if telemetry.get("storage_blocks_stored_events"):
        out["KV events: BlockStored medium=STORAGE from the decode instance (ZMQ)"] = (
            telemetry["storage_blocks_stored_events"].get("decode0", 0) > 0)
        out["metrics: vllm:dualpath_loaded_blocks_total (pe) and saved_blocks_total"] = (
            telemetry["prefill_loaded_blocks_pe"] > 0 and telemetry["decode_saved_blocks"] > 0)
    for name in ("decode0", "prefill0"):
        r = result.get(name) or {}
        out[f"failover {name}: every request not yet streaming succeeded"] = (
            r.get("failed_not_yet_streaming") == 0 and r.get("requests_not_yet_streaming", 0) > 0)
        out[f"failover {name}: their tokens = a run without the kill"] = (
            r.get("identical_not_yet_streaming") == r.get("requests_not_yet_streaming"))
        out[f"failover {name}: back in service after its restart, same tokens"] = bool(
            r.get("after_restart_identical"))
        out[f"failover {name}: no process of the killed server left"] = (
            r.get("old_group_left") == [])
    return out


def shm_left(cluster_tag: str) -> list[str]:
    """`/dev/shm` entries named with the cluster's tag (`dp<launcher pid>.`)."""
    return sorted(p.name for p in reaper.SHM.iterdir() if cluster_tag in p.name)
