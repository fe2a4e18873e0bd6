"""The scheduler process's state around `dualpath.sched` (no processes): DE-first binding,
HBM promised but not yet delivered counts against a DE, read plans reach both engines; the
scheduler's message loop; and a node or scheduler failure ends a run with a one-line error."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import pytest

from dualpath.core.blocks import block_keys
from dualpath.core.errors import SpecError
from dualpath.runtime.agent_replay import agents_from_lengths, replay
from dualpath.runtime.emulated_cluster import Cluster, RunError
from dualpath.runtime.messages import (
    EngineLoad,
    Fetch,
    Fetched,
    Message,
    NodeFailed,
    NodeStats,
    SchedulerStats,
    Shutdown,
    TurnDone,
    TurnSpec,
)
from dualpath.runtime.model.sampling import SamplingParams
from dualpath.runtime.run_config import RunConfig
from dualpath.runtime.scheduler_process import (
    SCHEDULER_NODE,
    RuntimeScheduler,
    SchedulerConfig,
    Submitted,
    serve_scheduler,
)
from dualpath.sched.params import PathMode, SchedulerParams
from dualpath.sched.types import WaitingRequest

BS = 64
KV = 1024  # bytes per token


def make(forced: str | None = None) -> RuntimeScheduler:
    params = SchedulerParams(
        alpha_tokens=1e9,
        beta_tokens=1e9,
        kv_bytes_per_token=KV,
        block_size_tokens=BS,
        path_mode=PathMode.DUAL,
    )
    return RuntimeScheduler(SchedulerConfig(params, 1, 1, 2, forced_read_side=forced))


def submit(s: RuntimeScheduler, rid: int, prompt: int, hit_blocks: int, gen: int = 8) -> None:
    s.submit(_submitted(rid, prompt, hit_blocks, gen))


def loads(node: int, free_hbm: int, read_q: int = 0) -> tuple[EngineLoad, ...]:
    return tuple(EngineLoad(node * 2 + i, 0, 0, read_q, free_hbm) for i in range(2))


def test_de_first_then_pe_with_read_plans_for_both_sides() -> None:
    s = make()
    submit(s, 1, 300, 4)
    submit(s, 2, 200, 2)
    assert s.on_fetch(Fetch(0, loads(0, 1 << 30))).prefill == ()  # no DE bound yet
    assert s.on_fetch(Fetch(1, loads(1, 1 << 30))).decode == ()  # bound, plan not known yet
    pe = s.on_fetch(Fetch(0, loads(0, 1 << 30)))
    assert [t.request_id for t in pe.prefill] == [1, 2]
    de = s.on_fetch(Fetch(1, loads(1, 1 << 30)))
    assert [t.request_id for t in de.decode] == [1, 2]
    for p, d in zip(pe.prefill, de.decode, strict=True):
        assert (p.de_engine, p.num_pe_blocks, p.turn) == (d.de_engine, d.num_pe_blocks, d.turn)
        assert p.de_node == 1 and d.pe_node == 0
    assert s.num_waiting == 0


def test_undelivered_requests_count_against_the_des_memory() -> None:
    s = make()
    need = (300 + 8) * KV  # prompt + generated tokens' KV
    for rid in range(3):
        submit(s, rid, 300, 4)
    # Each DE has room for exactly one request.
    s.on_fetch(Fetch(1, loads(1, need)))
    assert s.num_waiting == 3
    s.on_fetch(Fetch(0, loads(0, 1 << 30)))
    # The node has not received its two requests yet and still reports the same free memory:
    # the scheduler must not bind the third one to either DE.
    assert s.on_fetch(Fetch(1, loads(1, need))).decode != ()
    s.on_fetch(Fetch(0, loads(0, 1 << 30)))
    assert s.num_waiting == 1


def test_cancel_drops_a_queued_request_and_forwards_an_assigned_one() -> None:
    s = make()
    submit(s, 1, 300, 4)
    submit(s, 2, 300, 4)
    assert s.cancel(1) == ("dropped", -1)  # in the global queue
    s.on_fetch(Fetch(1, loads(1, 1 << 30)))  # request 2 bound to a DE, waiting for a PE
    assert s.cancel(2) == ("dropped", -1)
    assert s.num_waiting == 0 and s.on_fetch(Fetch(0, loads(0, 1 << 30))).prefill == ()
    assert s.on_fetch(Fetch(1, loads(1, 1 << 30))).decode == ()
    submit(s, 3, 300, 4)
    s.on_fetch(Fetch(1, loads(1, 1 << 30)))
    s.on_fetch(Fetch(0, loads(0, 1 << 30)))  # the PE has it: the DE must end it
    assert s.cancel(3) == ("forward", 1)
    s.finished(3)
    assert s.cancel(3) == ("unknown", -1) and s.cancel(99) == ("unknown", -1)


def test_forced_de_side_reads_every_hit_on_the_de_node() -> None:
    s = make(forced="de")
    submit(s, 1, 300, 4)
    s.on_fetch(Fetch(1, loads(1, 1 << 30)))
    (task,) = s.on_fetch(Fetch(0, loads(0, 1 << 30, read_q=0))).prefill
    assert task.num_pe_blocks == 0 and task.turn.num_hit_blocks == 4


def test_the_runtime_runs_de_first_with_the_prompt_charge_only() -> None:
    base = make().cfg.params
    for field, value in (("assignment_order", "pe-first"), ("de_tok_charge", "miss"),
                         ("pe_tok_charge", "prompt+gen")):
        with pytest.raises(SpecError, match=field):
            SchedulerConfig(base.with_overrides(**{field: value}), 1, 1, 2)


def test_submitting_twice_is_refused() -> None:
    s = make()
    submit(s, 1, 100, 1)
    with pytest.raises(Exception, match="submitted twice"):
        submit(s, 1, 100, 1)


def test_node_failure_ends_the_run_with_one_line(tmp_path: Path) -> None:
    # A 2-block DE/PE buffer cannot hold a 5-block prompt: the node's reader fails.
    cfg = RunConfig(
        mode="dualpath",
        store_root=str(tmp_path),
        launch="thread",
        num_prefill_nodes=1,
        num_decode_nodes=1,
        engines_per_node=1,
        buffer_bytes=2 * 64 * KV,
        hbm_bytes=1 << 20,
        transfer_kind="shm",
    )
    cluster = Cluster(cfg)
    with pytest.raises(
        RunError,
        match=r"^node \d failed: BufferFullError: .*5 slots requested, "
        r"pool holds 2",
    ) as info:
        replay(cluster, agents_from_lengths([([300], [2])], cluster.vocab_size, 0), timeout_s=60)
    assert "\n" not in str(info.value)
    assert "Traceback" in cluster.failure_traceback
    cluster.close()


def _submitted(rid: int, prompt: int, hit_blocks: int, gen: int = 8) -> Submitted:
    tokens = tuple(range(prompt))
    return Submitted(
        WaitingRequest(rid, prompt, hit_blocks * BS, gen),
        TurnSpec(tokens, tuple(block_keys(tokens, BS)), hit_blocks),
        SamplingParams(max_tokens=gen, seed=rid),
    )


def reply(q: queue.Queue[Message]) -> Fetched:
    msg = q.get(timeout=5)
    assert isinstance(msg, Fetched)
    return msg


def test_scheduler_process_serves_fetches_by_messages_only() -> None:
    """`serve_scheduler` (here a thread, in `dualpath run` a process) gets turns from the
    driver and fetches from the group leaders, answers each leader on its own inbox (an empty
    reply after the long poll), forwards TurnDone and node messages to the driver, and sends
    its stats on Shutdown."""
    params = SchedulerParams(
        alpha_tokens=1e9, beta_tokens=1e9, kv_bytes_per_token=KV, block_size_tokens=BS
    )
    inbox: queue.Queue[Message] = queue.Queue()
    nodes: dict[int, queue.Queue[Message]] = {0: queue.Queue(), 1: queue.Queue()}
    driver: queue.Queue[Message] = queue.Queue()
    cfg = SchedulerConfig(params, 1, 1, 2)
    t = threading.Thread(target=serve_scheduler, args=(cfg, inbox, nodes, driver, 0.02))
    t.start()
    try:
        inbox.put(Fetch(0, loads(0, 1 << 30)))
        assert reply(nodes[0]) == Fetched()  # nothing to do: answered after the poll
        inbox.put(_submitted(1, 300, 2))
        inbox.put(Fetch(1, loads(1, 1 << 30)))  # binds a DE
        assert reply(nodes[1]) == Fetched()
        inbox.put(Fetch(0, loads(0, 1 << 30)))
        (task,) = reply(nodes[0]).prefill
        assert task.request_id == 1 and task.de_node == 1
        inbox.put(Fetch(1, loads(1, 1 << 30)))
        (dtask,) = reply(nodes[1]).decode
        assert dtask.de_engine == task.de_engine
        done = TurnDone(1, (5, 6), 1.0, 2.0)
        inbox.put(done)
        inbox.put(NodeStats(node=0))
        assert driver.get(timeout=5) == done
        assert driver.get(timeout=5) == NodeStats(node=0)
    finally:
        inbox.put(Shutdown())
        t.join(timeout=5)
    stats = driver.get(timeout=5)
    # Every answer of a parked fetch counts too.
    assert isinstance(stats, SchedulerStats) and stats.num_fetches >= 4


def test_scheduler_failure_reaches_the_driver_as_one_line() -> None:
    params = SchedulerParams(
        alpha_tokens=1e9, beta_tokens=1e9, kv_bytes_per_token=KV, block_size_tokens=BS
    )
    inbox: queue.Queue[Message] = queue.Queue()
    driver: queue.Queue[Message] = queue.Queue()
    inbox.put(_submitted(1, 100, 1))
    inbox.put(_submitted(1, 100, 1))
    serve_scheduler(SchedulerConfig(params, 1, 1, 2), inbox, {}, driver)
    failed = driver.get(timeout=5)
    assert isinstance(failed, NodeFailed) and failed.node == SCHEDULER_NODE
    assert "submitted twice" in failed.error and "\n" not in failed.error
