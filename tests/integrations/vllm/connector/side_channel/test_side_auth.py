"""The staging service admits only peers that prove the cluster's shared secret: a peer
without it, or with another, gets no slot and no data, is logged and cut off; without a
secret the service serves loopback only."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from dualpath.integrations.vllm.connector.side_channel.auth import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    SecretError,
    load_secret,
)
from dualpath.integrations.vllm.connector.side_channel.client import SideChannelClient
from dualpath.integrations.vllm.connector.side_channel.staging import StagingPool
from dualpath.integrations.vllm.connector.side_channel.tcp_server import DecodeSideChannel
from dualpath.integrations.vllm.connector.side_channel.wire import (
    Alloc,
    Challenge,
    Failed,
    SideChannelError,
    decode,
    encode,
)
from dualpath.store import BlockStore
from dualpath.transport.slots import SlotPool

SECRET = b"s" * 32
KEY = b"\x07" * 16


@pytest.fixture()
def service(tmp_path: Path) -> Any:
    pool = StagingPool(SlotPool(None, 64, 2))
    store = BlockStore(tmp_path, 64, is_durable=False)
    store.put(KEY, b"p" * 64)  # prompt content a stranger must not read
    records: list[dict[str, Any]] = []
    channel = DecodeSideChannel("127.0.0.1:0", pool, store, b"meta", lambda m: "peer", "ns",
                                log=records.append, secret=SECRET)
    yield channel, pool, records
    channel.close()
    pool.close()


def test_a_peer_with_the_secret_is_served(service: Any) -> None:
    channel, pool, _ = service
    client = SideChannelClient(channel.address, secret=SECRET)
    try:
        assert client.hello().namespace == "ns"
        assert len(client.stage("x", 0, [KEY]).slots) == 1
        assert channel.num_refused == 0
    finally:
        client.close()


@pytest.mark.parametrize("secret", [b"w" * 32, None], ids=["wrong secret", "no secret"])
def test_a_peer_without_the_secret_gets_no_slot_and_no_data(
        service: Any, secret: bytes | None) -> None:
    channel, pool, records = service
    with pytest.raises(SideChannelError, match="not authenticated|requires the cluster's"):
        SideChannelClient(channel.address, secret=secret)
    assert pool.num_free == 2
    if secret is not None:  # the service saw the wrong proof and logged it
        assert channel.num_refused == 1
        assert records[-1]["event"] == "side_channel_refused"
        assert "wrong proof" in records[-1]["reason"]


def test_a_raw_peer_that_skips_the_proof_is_refused_and_cut_off(service: Any) -> None:
    channel, pool, records = service
    host, port = channel.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        f = sock.makefile("rb")
        challenge = decode(f.readline())
        assert isinstance(challenge, Challenge) and challenge.is_required
        sock.sendall(encode(Alloc("x", (0, 1))))
        reply = decode(f.readline())
        assert isinstance(reply, Failed) and "alloc before authenticating" in reply.error
        sock.sendall(encode(Alloc("x", (0, 1))))  # the connection is closed: nothing more
        assert f.readline() == b""
    assert pool.num_free == 2 and channel.num_refused == 1
    assert json.dumps(records[-1])  # the refusal is one event-log record


def test_without_a_secret_only_loopback_is_served(tmp_path: Path) -> None:
    pool = StagingPool(SlotPool(None, 64, 1))
    store = BlockStore(tmp_path, 64, is_durable=False)
    try:
        with pytest.raises(SideChannelError, match="needs the cluster's shared secret"):
            DecodeSideChannel("0.0.0.0:0", pool, store, b"meta", lambda m: "peer")
        channel = DecodeSideChannel("127.0.0.1:0", pool, store, b"meta", lambda m: "peer")
        client = SideChannelClient(channel.address)  # no challenge to answer
        assert client.hello().agent == b"meta"
        client.close()
        channel.close()
    finally:
        pool.close()


def test_the_secret_comes_from_the_config_the_environment_or_a_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    assert load_secret() is None
    extra = {"side_channel_secret": "c" * 20}
    assert load_secret(extra.get) == b"c" * 20
    monkeypatch.setenv(SECRET_ENV, "e" * 20)
    assert load_secret() == b"e" * 20 and load_secret(extra.get) == b"c" * 20
    monkeypatch.delenv(SECRET_ENV)
    (tmp_path / "secret").write_text("f" * 20 + "\n")
    monkeypatch.setenv(SECRET_FILE_ENV, str(tmp_path / "secret"))
    assert load_secret() == b"f" * 20
    with pytest.raises(SecretError, match="at least 16"):
        load_secret({"side_channel_secret": "short"}.get)
    monkeypatch.setenv(SECRET_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(SecretError, match="missing"):
        load_secret()


def test_the_service_process_takes_the_secret_from_its_environment_only(
        tmp_path: Path) -> None:
    """As the decode connector starts it: the secret reaches the process in its environment
    (never its command line); a peer with another secret is refused."""
    pytest.importorskip("nixl", reason="nixl (UCX) is part of make setup")
    from dualpath.integrations.vllm.cluster.ports import free_port
    from dualpath.integrations.vllm.connector.side_channel.service import spawn_side_channel

    address = f"127.0.0.1:{free_port()}"
    proc, pool = spawn_side_channel(address, str(tmp_path), 64, 2, None, None, "ns",
                                    secret=SECRET)
    try:
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert SECRET not in cmdline
        SideChannelClient(address, secret=SECRET).close()
        with pytest.raises(SideChannelError, match="wrong proof"):
            SideChannelClient(address, secret=b"w" * 32)
        pool.close()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
