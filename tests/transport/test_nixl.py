"""The one NIXL agent: real UCX transfers between two agents in one process, its errors as
`TransferError`s, a wait that gives up instead of spinning for ever, memory types."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("nixl", reason="nixl (UCX) is part of make setup")

from dualpath.transport.nixl import NixlAgent, agent_name, tensor_memory
from dualpath.transport.transfer_error import TransferError


@dataclass
class Two:
    target: NixlAgent
    initiator: NixlAgent
    peer: str
    there: np.ndarray
    here: np.ndarray


@pytest.fixture(scope="module")
def two() -> Iterator[Two]:
    target = NixlAgent(agent_name("target"), progress_thread=True)
    initiator = NixlAgent(agent_name("initiator"), progress_thread=False)
    there = np.zeros(1 << 16, np.uint8)
    here = np.zeros(1 << 16, np.uint8)
    target.register([(there.ctypes.data, there.nbytes)])
    initiator.register([(here.ctypes.data, here.nbytes)])
    peer = initiator.connect(target.metadata())
    yield Two(target, initiator, peer, there, here)
    initiator.close()
    target.close()


def addr(a: np.ndarray, offset: int = 0) -> int:
    return int(a.ctypes.data) + offset


def test_write_then_read_back_moves_every_descriptor(two: Two) -> None:
    t = two
    t.here[:] = np.arange(t.here.size) % 251
    # One batch of two descriptors: the halves of the first 8 KiB land swapped.
    moved = t.initiator.transfer("WRITE", t.peer, [(addr(t.here), addr(t.there, 4096), 4096),
                                                   (addr(t.here, 4096), addr(t.there), 4096)])
    assert moved == 8192
    assert (t.there[4096:8192] == t.here[:4096]).all()
    assert (t.there[:4096] == t.here[4096:8192]).all()
    t.there[-16:] = 7
    last = addr(t.there, t.there.size - 16)
    pending = t.initiator.post("READ", t.peer, [(addr(t.here, 100), last, 16)])
    assert pending is not None and pending.wait() == 16 and pending.wait() == 16
    assert (t.here[100:116] == 7).all()
    assert t.initiator.post("READ", t.peer, []) is None


def test_failures_are_transfer_errors_not_crashes(two: Two) -> None:
    t = two
    with pytest.raises(TransferError, match="not connected"):
        t.initiator.post("WRITE", "nobody", [(addr(t.here), addr(t.there), 8)])
    with pytest.raises(TransferError, match="outside registered memory"):
        t.initiator.post("WRITE", t.peer, [(addr(t.here, t.here.size - 4), addr(t.there), 8)])
    # Bytes the peer never registered: NIXL's own error, as a TransferError.
    with pytest.raises(TransferError, match="could not start"):
        t.initiator.post("READ", t.peer, [(addr(t.here), addr(t.there, 1 << 30), 8)])
    with pytest.raises(TransferError, match="cannot add a peer"):
        t.initiator.connect(b"not an agent")
    with pytest.raises(TransferError, match="memory type 'HBM'"):
        t.initiator.register([(addr(t.here), 8)], "HBM")


def test_prepared_lists_move_the_entries_named_by_index(two: Two) -> None:
    t = two
    page = 256
    here = t.initiator.prep(np.arange(16, dtype=np.uint64) * page + addr(t.here), page)
    there = t.initiator.prep(np.arange(16, dtype=np.uint64) * page + addr(t.there), page,
                             peer=t.peer)
    t.here[:16 * page] = np.arange(16 * page) % 253
    t.there[:16 * page] = 0
    # Local entries 3, 4, 9 into remote entries 7, 0, 15: each page where its index says.
    pending = t.initiator.post_prepped("WRITE", here, np.array([3, 4, 9]), there,
                                       np.array([7, 0, 15]))
    assert pending is not None and pending.wait() == 3 * page
    for lo, ro in ((3, 7), (4, 0), (9, 15)):
        assert (t.there[ro * page:(ro + 1) * page] == t.here[lo * page:(lo + 1) * page]).all()
    assert not t.there[page:7 * page].any()
    t.here[:16 * page] = 0
    pending = t.initiator.post_prepped("READ", here, np.array([1]), there, np.array([7]))
    assert pending is not None and pending.wait() == page
    assert (t.here[page:2 * page] == t.there[7 * page:8 * page]).all()
    assert t.initiator.post_prepped("READ", here, np.array([], int), there,
                                    np.array([], int)) is None
    with pytest.raises(TransferError, match="outside a list of 16"):
        t.initiator.post_prepped("READ", here, np.array([16]), there, np.array([0]))
    with pytest.raises(TransferError, match="1 local and 2 remote"):
        t.initiator.post_prepped("READ", here, np.array([1]), there, np.array([0, 1]))
    with pytest.raises(TransferError, match="outside registered memory"):
        t.initiator.prep(np.array([addr(t.here, t.here.size - 8)], np.uint64), 16)
    with pytest.raises(TransferError, match="not connected"):
        t.initiator.prep(np.array([addr(t.there)], np.uint64), 16, peer="nobody")


def test_memory_deregistered_is_no_longer_a_transfers(two: Two) -> None:
    """A buffer registered, prepared, moved through, its list released and deregistered (a
    bounce buffer replaced by a larger one): neither can be used again."""
    t = two
    extra = np.zeros(4096, np.uint8)
    t.initiator.register([(addr(extra), extra.nbytes)])
    there = t.initiator.prep(np.array([addr(t.there)], np.uint64), 1024, peer=t.peer)
    mine = t.initiator.prep(np.array([addr(extra)], np.uint64), 1024)
    t.there[:1024] = 7
    pending = t.initiator.post_prepped("READ", mine, np.array([0]), there, np.array([0]))
    assert pending is not None and pending.wait() == 1024
    assert (extra[:1024] == 7).all()
    t.initiator.release(mine)
    t.initiator.release(mine)  # once is enough; again is nothing
    t.initiator.deregister([(addr(extra), extra.nbytes)])
    t.initiator.deregister([(addr(extra), extra.nbytes)])
    with pytest.raises(TransferError, match="outside registered memory"):
        t.initiator.prep(np.array([addr(extra)], np.uint64), 1024)
    with pytest.raises(TransferError, match="outside registered memory"):
        t.initiator.post("READ", t.peer, [(addr(extra), addr(t.there), 1024)])
    t.initiator.release(there)


def test_tensors_register_once_each_as_their_memory_type(two: Two) -> None:
    kv = torch.zeros(4, 1024, dtype=torch.uint8)
    t = two
    t.initiator.register_tensors([kv, kv, kv[0:4]])  # one storage, registered once
    pending = t.initiator.post("READ", t.peer, [(int(kv.data_ptr()), addr(t.there), 4096)])
    assert pending is not None and pending.wait() == 4096
    assert torch.equal(kv.flatten(), torch.from_numpy(t.there[:4096]))
    assert tensor_memory(kv) == ("DRAM", 0)
    on_gpu = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=3))
    assert tensor_memory(on_gpu) == ("VRAM", 3)


TIMEOUT_SCRIPT = """
import sys, time
import numpy as np
from dualpath.transport.transfer_error import TransferError
from dualpath.transport.nixl import NixlAgent, agent_name

target = NixlAgent(agent_name("target"), progress_thread=sys.argv[1] == "1")
initiator = NixlAgent(agent_name("initiator"), progress_thread=False)
there, here = np.zeros(1 << 20, np.uint8), np.ones(1 << 20, np.uint8)
target.register([(there.ctypes.data, there.nbytes)])
initiator.register([(here.ctypes.data, here.nbytes)])
peer = initiator.connect(target.metadata())
t0 = time.monotonic()
try:
    initiator.transfer("WRITE", peer, [(here.ctypes.data, there.ctypes.data, here.nbytes)],
                       timeout_s=1.0)
    print("done", int(there.all()), time.monotonic() - t0)
except TransferError as e:
    print("error", e, time.monotonic() - t0)
"""


@pytest.mark.parametrize("progress", [False, True])
def test_a_transfer_nobody_progresses_times_out(progress: bool) -> None:
    """Over UCX's TCP transport a one-sided WRITE needs the target to progress: without its
    progress thread it never completes, and the wait gives up after its timeout (the
    runtime's former loop polled on for ever)."""
    run = subprocess.run([sys.executable, "-c", TIMEOUT_SCRIPT, str(int(progress))],
                         capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "UCX_TLS": "tcp"})
    assert run.returncode == 0, run.stderr[-2000:]
    outcome, *rest = run.stdout.strip().splitlines()[-1].split()
    if progress:
        assert outcome == "done" and rest[0] == "1"
    else:
        assert outcome == "error" and "no completion in 1 s" in " ".join(rest)
        assert float(rest[-1]) < 10
