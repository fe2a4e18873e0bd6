"""A prefill worker's background DE-side load (`pull_whole`, which `AsyncLoader` runs): the
decode node stages the blocks in pieces (`stage_chunks`) and this worker pulls each piece
as soon as it is staged, so the decode node's store reads of one piece overlap the pull of
the one before."""

from __future__ import annotations

import contextlib
import itertools
import threading

import torch

from dualpath.integrations.vllm.connector.pages import scatter_pages
from dualpath.integrations.vllm.connector.peers import DecodePeers
from dualpath.integrations.vllm.connector.side_channel.wire import (
    SideChannelError,
    Stage,
    Staged,
)
from dualpath.integrations.vllm.connector.step_plan import RemoteLoad
from dualpath.transport.transfer_error import TransferError

STAGE_PIECES = 4
"""A background DE-side load is staged in this many pieces (`stage_chunks`), so that the decode
instance's store reads of one piece overlap this worker's pull of the one before."""

MIN_STAGE_PIECE_BLOCKS = 8
"""...of at least this many blocks each (a piece's store reads run in parallel)."""


def stage_chunks(num_blocks: int, pieces: int = STAGE_PIECES, first_block: int = 0,
                 blocks_per_file: int = 1) -> list[tuple[int, int]]:
    """The [lo, hi) ranges (relative to `first_block`) a background load of `num_blocks` is
    staged and pulled in: at most `pieces`, each of at least `MIN_STAGE_PIECE_BLOCKS` and
    ending on a file's edge (files of `blocks_per_file` blocks, so no file is read twice),
    the last one where the load ends."""
    g = blocks_per_file
    size = max(MIN_STAGE_PIECE_BLOCKS, -(-num_blocks // pieces))
    bounds = [0]
    while bounds[-1] < num_blocks:
        end = first_block + bounds[-1] + size
        bounds.append(min(num_blocks, -(-end // g) * g - first_block))
    return list(itertools.pairwise(bounds))


BOUNCE_CHUNK_BYTES = 1 << 29
"""A background pull through the host (`pull_whole`) bounces at most this many
bytes at a time (a request's whole hit would pin as much host memory as it has KV)."""


class _Partial(Exception):
    """A background pull that loaded its first `ok` blocks, then failed with `error`."""

    def __init__(self, ok: int, error: Exception) -> None:
        super().__init__(str(error))
        self.ok = ok
        self.error = error



def pull_whole(peers: DecodePeers, r: RemoteLoad, num_pieces: int = STAGE_PIECES) -> int:
    """A background DE-side load: staged and pulled in `num_pieces` pieces (`stage_chunks`),
    pipelined: every piece's `stage` is sent at once, so the decode instance reads piece k+1
    from its store while this worker pulls piece k (one NIXL READ of every layer's page of
    the piece's blocks into the paged KV, through the host when bouncing), waited for;
    returns the blocks loaded (a prefix)."""
    t = r.blocks
    ok = 0
    try:
        client, peer = peers.peer(r.de)
        xfer, first, keys, _ = peers.stage_args(r)
        g = t.blocks_per_file
        pieces = stage_chunks(len(t.block_ids), num_pieces, first, g)
        for lo, hi in pieces:  # a piece's files: those holding its blocks
            k0 = (first + lo) // g - first // g
            k1 = (first + hi - 1) // g - first // g + 1
            client.send(Stage(xfer, first + lo, keys[k0:k1], hi - lo))
        replies = 0
        try:
            for lo, hi in pieces:
                slots = client.receive(Staged).slots
                replies += 1
                pairs = list(zip(t.block_ids[lo:hi], slots, strict=False))
                ok += _pull_pairs(peers, r.de, peer, pairs)
                if len(slots) < hi - lo:
                    break  # a stage read failed: the rest is recomputed
        finally:  # the later pieces' replies: none may still be reading into a slot
            for _ in range(len(pieces) - replies):
                client.receive(Staged)
    except _Partial as e:
        ok += e.ok
        peers.kv.remote_error(t.req_id, "pull", str(e.error), thread=threading.get_ident())
        peers.drop(r.de)
    except (SideChannelError, TransferError, OSError) as e:
        peers.kv.remote_error(t.req_id, "pull", str(e), thread=threading.get_ident())
        peers.drop(r.de)
    peers.kv.count(pulled_blocks=ok)
    peers.kv.log_event({"event": "pull", "req_id": t.req_id, "de": r.de, "background": True,
                        "first_block": t.first_block, "blocks": len(t.block_ids), "ok": ok})
    return ok


def _pull_pairs(peers: DecodePeers, de: str, peer: str, pairs: list[tuple[int, int]]
                ) -> int:
    """`pull_whole`'s READ of one staged piece, waited for; returns its blocks (a failure
    raises, `_Partial` with the piece's blocks loaded before it)."""
    if peers.bounces is not None:
        return _pull_bounced(peers, de, peer, pairs)
    pending = peers.post("READ", de, peer, peers.entries(de, pairs), slice(None))
    if pending is not None:
        pending.wait()
    return len(pairs)


def _pull_bounced(peers: DecodePeers, de: str, peer: str, pairs: list[tuple[int, int]]
                  ) -> int:
    """`pull_whole`'s READ through a bounce buffer, `BOUNCE_CHUNK_BYTES` at a time, each
    chunk's rows then copied into the paged KV (on a stream of its own on a GPU); returns
    the blocks loaded, or raises `_Partial` with those loaded before a failure."""
    assert peers.bounces is not None
    if not pairs:
        return 0
    chunk = max(1, BOUNCE_CHUNK_BYTES // peers.kv.full_block_bytes)
    bounce = peers.bounces.take(min(len(pairs), chunk))
    first = peers.layers[0]
    stream = torch.cuda.Stream(first.device) if first.is_cuda else None  # type: ignore[no-untyped-call]
    ok = 0
    try:
        for start in range(0, len(pairs), chunk):
            part = pairs[start:start + chunk]
            pending = peers.post("READ", de, peer, peers.entries(de, part, bounce),
                                 slice(None), bounce)
            if pending is not None:
                pending.wait()
            with torch.cuda.stream(stream) if stream is not None \
                    else contextlib.nullcontext():
                ids = torch.tensor([b for b, _ in part], dtype=torch.int64,
                                   device=first.device)  # on that stream
                for i, layer in enumerate(peers.layers):
                    scatter_pages(layer, ids, bounce.buf[i, :len(part)])
            if stream is not None:
                stream.synchronize()
            ok += len(part)
    except (SideChannelError, TransferError, OSError) as e:
        if not ok:
            raise
        raise _Partial(ok, e) from None
    finally:
        peers.bounces.give(bounce)
    return ok
