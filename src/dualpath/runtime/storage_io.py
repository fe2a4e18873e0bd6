"""A node's storage I/O threads: the reader fills buffer slots with hit Full Blocks (FIFO; what
is still queued is the node's `read_q`), the writer persists completed Full Blocks and frees
their slots. Both are paced on the node's storage NIC."""

from __future__ import annotations

import sys

from dualpath.runtime.node_context import NodeContext
from dualpath.store import BlockStore
from dualpath.transport.pacing import sleep_until


def reader_loop(ctx: NodeContext) -> None:
    """FIFO storage reads into buffer slots, paced on the storage NIC's read port."""
    store = BlockStore(ctx.cfg.store_root, ctx.layout.full_block_bytes, is_durable=False)
    while True:
        job = ctx.read_queue.get()
        if job is None:
            break
        job.slots = ctx.pool.alloc(job.num_slots)
        valid = 0
        is_broken = False
        for index, key in job.blocks:
            if not is_broken:
                # The emulated transfer runs while the real read happens (then we wait for it).
                done_at = ctx.nics.storage_read.reserve(ctx.layout.full_block_bytes)
                ok = store.get_into(key, ctx.pool.slot(job.slots[index]))
                ctx.count("snic_read", ctx.layout.full_block_bytes)
                sleep_until(done_at)
                if ok:
                    valid += 1
                else:
                    is_broken = True  # a missing/corrupt block ends the usable prefix
            ctx.add_read_q(-job.block_size)
        job.num_valid_blocks = valid
        for name in ("num_hits", "num_misses", "num_corrupt", "num_unreadable"):
            ctx.store_counters[name] = getattr(store.counters, name)
        job.done.set()
        job.on_done(job)


def writer_loop(ctx: NodeContext) -> None:
    """Persist completed Full Blocks (atomic put), paced on the storage NIC's write port; the
    slot is freed only after the block is stored (its successor holds it).

    A put that fails (a full disk, a read-only store) skips that block: it is counted and will
    be a cache miss, recomputed, so serving goes on. The first failure is printed with why.
    """
    store = BlockStore(ctx.cfg.store_root, ctx.layout.full_block_bytes, is_durable=False)
    while True:
        item = ctx.write_queue.get()
        if item is None:
            break
        if callable(item):
            item()
            continue
        key, slot = item
        done_at = ctx.nics.storage_write.reserve(ctx.layout.full_block_bytes)
        try:
            store.put(key, ctx.pool.slot(slot), overwrite=False)
        except OSError as exc:
            if store.counters.num_failed_puts == 1:
                print(f"dualpath node {ctx.cfg.node}: warning: cannot persist KV blocks to "
                      f"{ctx.cfg.store_root} ({exc.strerror or exc}); skipping them (each is a "
                      "later cache miss, recomputed) and counting them as unpersisted_blocks",
                      file=sys.stderr, flush=True)
            ctx.store_counters["num_failed_puts"] = store.counters.num_failed_puts
            if ctx.unpersisted is not None:
                ctx.unpersisted[ctx.cfg.node] = store.counters.num_failed_puts
        ctx.count("snic_write", ctx.layout.full_block_bytes)
        sleep_until(done_at)
        ctx.pool.free([slot])
        ctx.store_counters["num_puts"] = store.counters.num_puts
