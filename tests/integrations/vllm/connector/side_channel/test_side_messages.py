"""The side channel's typed messages: every message survives the wire, and a line that is not
one of this protocol's messages is refused by name; failures reach the client as errors."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from dualpath.integrations.vllm.connector.side_channel.client import SideChannelClient
from dualpath.integrations.vllm.connector.side_channel.staging import StagingPool
from dualpath.integrations.vllm.connector.side_channel.tcp_server import DecodeSideChannel
from dualpath.integrations.vllm.connector.side_channel.wire import (
    PROTOCOL_VERSION,
    REPLY_OF,
    Alloc,
    Auth,
    Challenge,
    Commit,
    Done,
    Failed,
    Found,
    Hello,
    Lookup,
    Release,
    SideChannelError,
    Slots,
    Stage,
    Staged,
    Welcome,
    decode,
    encode,
    expect,
)
from dualpath.store import BlockStore
from dualpath.transport.slots import SlotPool

MESSAGES = [
    Hello(), Hello(b"\x00agent\xff"), Stage("x", 3, (b"\x01" * 16, b"\x02" * 16)),
    Alloc("x", (4, 5)), Commit("x"), Lookup("x", (0, 1)), Release("x"),
    Welcome(b"meta", 4096, "ns", 8, "dualpath-staging-1", 1 << 40), Staged((1 << 40, 7), 0.25),
    Slots((1 << 40,)), Found((3, None, 0)), Done(), Failed("why"),
    Auth(b"\x01" * 32), Challenge(b"\x02" * 32, True), Challenge(b"", False),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_survives_the_wire(msg: object) -> None:
    line = encode(msg)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode(line) == msg


def test_every_request_has_a_reply_type() -> None:
    assert set(REPLY_OF) == {Auth, Hello, Stage, Alloc, Commit, Lookup, Release}


@pytest.mark.parametrize(("line", "why"), [
    (b"{not json", "not a side-channel message"),
    (b"[1]", "not a JSON object"),
    (b'{"type": "Commit", "xfer": "x"}', "protocol vNone"),
    (b'{"v": %d, "type": "Commit", "xfer": "x"}' % (PROTOCOL_VERSION + 1), "speaks"),
    (b'{"v": %d, "type": "Explode"}' % PROTOCOL_VERSION, "unknown side-channel message type"),
    (b'{"v": %d, "type": "Commit"}' % PROTOCOL_VERSION, "Commit: .*xfer"),
    (b'{"v": %d, "type": "Commit", "xfer": "x", "op": 1}' % PROTOCOL_VERSION,
     "unknown fields"),
    (b'{"v": %d, "type": "Alloc", "xfer": "x", "blocks": ["a"]}' % PROTOCOL_VERSION,
     "Alloc: 'a' is not int"),
])
def test_a_line_that_is_not_a_message_is_refused_by_name(line: bytes, why: str) -> None:
    with pytest.raises(SideChannelError, match=why):
        decode(line)


def test_a_failed_or_unexpected_reply_is_an_error() -> None:
    with pytest.raises(SideChannelError, match="side channel h:1: no room"):
        expect(Failed("no room"), Slots, "h:1")
    with pytest.raises(SideChannelError, match="a Done reply, expected Slots"):
        expect(Done(), Slots, "h:1")
    assert expect(Slots((1,)), Slots, "h:1") == Slots((1,))


def test_requests_over_tcp(tmp_path: Path) -> None:
    """A client and the server without NIXL: alloc, commit, lookup, release; a full pool and
    an unknown transfer come back as errors naming why, and the connection stays usable."""
    pool = StagingPool(SlotPool(None, 64, 2))
    store = BlockStore(tmp_path, 64, is_durable=False)
    channel = DecodeSideChannel("127.0.0.1:0", pool, store, b"meta", lambda m: "peer", "ns")
    client = SideChannelClient(channel.address)
    try:
        welcome = client.hello()
        assert welcome == Welcome(b"meta", 64, "ns", 2, pool.slots.name, pool.base)
        addresses = client.alloc("x", [0, 1])
        assert sorted(addresses) == [pool.address(0), pool.address(1)]
        with pytest.raises(SideChannelError, match="BufferFullError: .*full"):
            client.alloc("y", [0])
        with pytest.raises(SideChannelError, match="unknown transfer z"):
            client.commit("z")
        assert client.lookup("x", [0, 1]) == [None, None]  # not committed yet
        client.commit("x")
        assert sorted(s for s in client.lookup("x", [0, 1]) if s is not None) == [0, 1]
        client.release("x")
        assert pool.num_free == 2
        staged = client.stage("y", 0, [b"\x00" * 16])  # a block the store lacks
        assert staged.slots == ()
        client.release("y")
        assert pool.num_free == 2
    finally:
        client.close()
        channel.close()
        pool.close()


class _MeetingStore(BlockStore):
    """A real store whose reads wait at a barrier first: `parties` of them pass only when
    that many are in flight at once."""

    barrier: threading.Barrier | None = None

    def get_into(self, key: bytes, out: Any) -> bool:
        if self.barrier is not None:
            self.barrier.wait()
        return super().get_into(key, out)


def test_a_stage_reads_its_blocks_in_parallel_and_offers_the_prefix_before_a_failure(
        tmp_path: Path) -> None:
    pool = StagingPool(SlotPool(None, 64, 12))
    store = _MeetingStore(tmp_path, 64, is_durable=False)
    keys = [bytes([i]) * 16 for i in range(6)]
    for i, key in enumerate(keys):
        if i != 2:
            store.put(key, bytes([i]) * 64)
    channel = DecodeSideChannel("127.0.0.1:0", pool, store, b"meta", lambda m: "peer",
                                read_threads=4)
    client = SideChannelClient(channel.address)
    try:
        # Four reads meet at the barrier only if the stage has them in flight together (read
        # one after another, the first waits alone until the barrier breaks).
        store.barrier = threading.Barrier(4, timeout=10)
        staged = client.stage("x", 0, [keys[i] for i in (0, 1, 3, 4)])
        assert len(staged.slots) == 4
        assert [bytes(pool.view(s)[:1].numpy()) for s in client.lookup("x", [0, 1, 2, 3])] \
            == [b"\x00", b"\x01", b"\x03", b"\x04"]
        client.release("x")
        # Block 2 is missing: blocks 3.. are read meanwhile but not offered (the prefill
        # side recomputes from block 2 on), and their slots go back with the transfer.
        store.barrier = None
        staged = client.stage("y", 0, keys)
        assert staged.slots == tuple(pool.address(s) for s in client.lookup("y", [0, 1]))
        assert client.lookup("y", [2, 3, 4, 5]) == [None] * 4
        assert channel.num_staged_blocks == 6 and channel.num_stage_errors == 1
        client.release("y")
        assert pool.num_free == 12
    finally:
        client.close()
        channel.close()
        pool.close()
