"""Runtime data movement and end to end: storage -> buffer against the emulated storage NIC,
per-Layer-Block transfer overhead with and without doorbell batching, and tokens/s.

1. Storage -> engine memory on the PE read path: a node's real reader thread
   (`storage_io.reader_loop`: buffer-slot allocation, `BlockStore.get_into` = open + preadv + CRC
   check, pacing on the storage NIC's read port) reads SmolLM2-sized fp32 Full Blocks (2.95 MB)
   from a temp store while the engine copies each loaded block, layer by layer, into engine
   memory (`KVLayout.gather_layer`, charged to its compute NIC). Reported: bytes/s from the
   first read to the last copy, against the emulated storage-NIC limit of the `cpu-emulated`
   preset (200 MiB/s per node); goal >= 90%.
2. Layer-Block transfers: `n` Layer Blocks of the tiny model (16 KiB) copied from one node's
   buffer segment into another's through the transfer engine (shared memory, and NIXL/UCX when
   installed), each charged to an (unpaced) compute-NIC port as the engines do. Batched: one
   descriptor list and one charge per layer; unbatched: one call per block. Reported: time per
   Layer Block in microseconds and the overhead above a bare memcpy of the same bytes measured
   in the same process (the baseline).
3. PE forward passes (compute only: oracle mode, 1P1D, one engine per node, 6 agents with one
   1200-token uncached prompt each): the default 300 ms quota on the start-up-measured
   estimator, an unbounded quota (every runnable request whole in one pass: the baseline), and
   a 256-token cap per pass (each chunk reloads the earlier chunks' KV from the PE buffer).
   Reported: medians over `--repeats // 2` of JCT and mean TTFT, passes, and ratios.
4. End to end: the I/O-bound 1P2D configuration of `tests/runtime/test_run.py` (tiny model,
   storage NIC 2 MiB/s, 8 agents whose 2nd and 3rd turns hit ~1000 tokens) in modes basic, dualpath
   and oracle (node threads): JCT, tokens/s, and the speedups.

Medians over `--repeats` after a warm-up. Run:
`.venv/bin/python benchmarks/runtime/bench_runtime.py` (about 60 s on 2 cores).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from dualpath.core.blocks import block_key
from dualpath.core.hardware import hardware_preset
from dualpath.runtime.agent_replay import agents_from_lengths, replay
from dualpath.runtime.emulated_cluster import Cluster
from dualpath.runtime.kvlayout import KVLayout
from dualpath.runtime.model.model_source import ModelSource
from dualpath.runtime.node_context import NodeConfig, NodeContext, ReadJob
from dualpath.runtime.run_config import RunConfig
from dualpath.runtime.storage_io import reader_loop
from dualpath.runtime.traffic import NodeNics, TrafficManager
from dualpath.runtime.transfer import make_transfer_engine
from dualpath.store import BlockStore
from dualpath.transport.nixl import is_nixl_available
from dualpath.transport.slots import SlotPool

MiB = 2**20
SMOLLM2 = KVLayout(num_layers=30, block_size=64, num_kv_heads=3, head_dim=64)
TINY = KVLayout(num_layers=4, block_size=64, num_kv_heads=2, head_dim=16)


def median(fn: Callable[[], float], repeats: int) -> float:
    fn()
    return statistics.median(fn() for _ in range(repeats))


def bench_storage_reads(repeats: int, num_blocks: int) -> dict[str, float]:
    snic = hardware_preset("cpu-emulated").storage_nic_bytes_per_s
    with tempfile.TemporaryDirectory() as root:
        store = BlockStore(root, SMOLLM2.full_block_bytes, is_durable=False)
        payload = bytes(range(256)) * (SMOLLM2.full_block_bytes // 256)
        keys = []
        parent = bytes(16)
        for i in range(num_blocks):
            parent = block_key(parent, [i] * SMOLLM2.block_size)
            store.put(parent, payload)
            keys.append(parent)
        cfg = NodeConfig(
            node=0,
            is_prefill=True,
            num_engines=1,
            layout=SMOLLM2,
            model=ModelSource("tiny"),
            store_root=root,
            buffer_bytes=(num_blocks + 1) * SMOLLM2.full_block_bytes,
            storage_nic_bytes_per_s=snic,
            compute_nic_bytes_per_s=4 * snic,
            hbm_bytes=1 << 30,
            is_layerwise=True,
            transfer_kind="shm",
            shm_prefix=f"bench{uuid.uuid4().hex[:6]}",
        )
        ctx = NodeContext(cfg, lambda _node, _msg: None)
        reader = threading.Thread(target=reader_loop, args=(ctx,), daemon=True)
        reader.start()
        tx, rx = ctx.nics.compute_tx[0], ctx.nics.compute_rx[0]

        def once() -> float:
            # One read job per block, so the engine copies block k into its memory (all layers,
            # through the compute NIC) while the storage NIC reads block k + 1.
            jobs = [
                ReadJob(0, 1, [(0, key)], SMOLLM2.block_size, on_done=lambda _j: None)
                for key in keys
            ]
            t0 = time.perf_counter()
            for job in jobs:
                ctx.read_queue.put(job)
            for job in jobs:
                job.done.wait()
                assert job.num_valid_blocks == 1
                block = [ctx.pool.slot(job.slots[0])]
                for layer in range(SMOLLM2.num_layers):
                    SMOLLM2.gather_layer(block, layer, SMOLLM2.block_size)
                ctx.charge([tx, rx], SMOLLM2.full_block_bytes, "h2d")
                ctx.pool.free(job.slots)
            elapsed = time.perf_counter() - t0
            return num_blocks * SMOLLM2.full_block_bytes / elapsed

        rate = median(once, repeats)
        ctx.read_queue.put(None)
        reader.join()
        ctx.close()
    return {"read_bytes_per_s": rate, "snic_bytes_per_s": snic, "fraction": rate / snic}


def bench_layer_blocks(kind: str, repeats: int, num_blocks: int) -> dict[str, float]:
    lbb = TINY.layer_block_bytes
    tag = uuid.uuid4().hex[:6]
    a = SlotPool(f"bl{tag}a", lbb * num_blocks, 1)
    b = SlotPool(f"bl{tag}b", lbb * num_blocks, 1)
    ea = make_transfer_engine(kind, 0, a.name, a.view, name_prefix=a.name)
    eb = make_transfer_engine(kind, 1, b.name, b.view, name_prefix=b.name)
    ea.connect(eb.local_info())
    eb.connect(ea.local_info())
    nics = NodeNics.create(0, 1, float("inf"), float("inf"))
    tm = TrafficManager()
    route = [nics.compute_tx[0]]
    descs = [(i * lbb, i * lbb, lbb) for i in range(num_blocks)]

    def batched() -> float:
        t0 = time.perf_counter()
        ea.write(1, descs)
        tm.charge(route, num_blocks * lbb)
        return (time.perf_counter() - t0) / num_blocks

    def unbatched() -> float:
        t0 = time.perf_counter()
        for d in descs:
            ea.write(1, [d])
            tm.charge(route, lbb)
        return (time.perf_counter() - t0) / num_blocks

    def memcpy() -> float:
        src, dst = a.view, b.view
        t0 = time.perf_counter()
        for lo, ro, n in descs:
            dst[ro : ro + n] = src[lo : lo + n]
        return (time.perf_counter() - t0) / num_blocks

    out = {
        "batched_us": median(batched, repeats) * 1e6,
        "unbatched_us": median(unbatched, repeats) * 1e6,
        "memcpy_us": median(memcpy, repeats) * 1e6,
    }
    ea.close()
    eb.close()
    a.close()
    b.close()
    return out


def bench_end_to_end() -> dict[str, dict[str, float]]:
    turns = [([1000 + 17 * a, 20, 20], [2, 2, 2]) for a in range(8)]
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("basic", "dualpath", "oracle"):
            cfg = RunConfig(
                mode=mode,
                store_root=str(Path(tmp) / mode),
                launch="thread",
                num_prefill_nodes=1,
                num_decode_nodes=2,
                engines_per_node=1,
                storage_nic_bytes_per_s=2 * MiB,
                compute_nic_bytes_per_s=16 * MiB,
                buffer_bytes=16 * MiB,
                hbm_bytes=32 * MiB,
            )
            cluster = Cluster(cfg)
            r = replay(cluster, agents_from_lengths(turns, cluster.vocab_size, seed=0))
            util = r.snic_read_utilization()
            out[mode] = {
                "jct_s": r.jct_s,
                "tokens_per_s": r.tokens_per_s,
                **{f"snic_util_n{n}": u for n, u in util.items()},
            }
    return out


PE_PACKING = {
    "quota 300 ms": {"compute_quota_s": 0.3},
    "unbounded": {"compute_quota_s": 1e6},
    "cap 256 tok": {"max_batch_tokens": 256},
}


def bench_pe_packing(repeats: int) -> dict[str, dict[str, float]]:
    turns = [([1200 + 7 * a], [2]) for a in range(6)]
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in PE_PACKING.items():
            jcts: list[float] = []
            ttfts: list[float] = []
            counters: dict[str, int] = {}
            for k in range(repeats):
                cfg = RunConfig(
                    mode="oracle",
                    store_root=str(Path(tmp) / f"{len(out)}-{k}"),
                    launch="thread",
                    num_prefill_nodes=1,
                    num_decode_nodes=1,
                    engines_per_node=1,
                    buffer_bytes=32 * MiB,
                    hbm_bytes=64 * MiB,
                    **overrides,  # type: ignore[arg-type]
                )
                cluster = Cluster(cfg)
                r = replay(cluster, agents_from_lengths(turns, cluster.vocab_size, seed=0))
                jcts.append(r.jct_s)
                ttfts.append(statistics.mean(t.first_token_at - t.submitted_at for t in r.turns))
                counters = r.engine_counters()
            passes = counters.get("num_prefill_passes", 0)
            out[name] = {
                "jct_s": statistics.median(jcts),
                "ttft_s": statistics.median(ttfts),
                "passes": float(passes),
                "entries_per_pass": counters.get("num_prefill_entries", 0) / max(1, passes),
                "chunks": float(counters.get("num_chunked_entries", 0)),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--read-blocks", type=int, default=32, help="Full Blocks per read run")
    parser.add_argument("--layer-blocks", type=int, default=2000)
    parser.add_argument("--skip-e2e", action="store_true")
    args = parser.parse_args()

    s = bench_storage_reads(args.repeats, args.read_blocks)
    print(
        f"storage -> engine memory, PE read path ({SMOLLM2.full_block_bytes / 1e6:.2f} MB Full "
        "Blocks; reader thread: preadv + CRC under SNIC pacing; engine: per-layer copies "
        "through its CNIC):"
    )
    print(
        f"  {s['read_bytes_per_s'] / MiB:8.1f} MiB/s of {s['snic_bytes_per_s'] / MiB:.0f} MiB/s "
        f"emulated storage NIC = {s['fraction']:.1%} (goal >= 90%)"
    )

    kinds = ["shm"] + (["nixl"] if is_nixl_available() else [])
    print(
        f"\nLayer-Block transfers ({TINY.layer_block_bytes // 1024} KiB each, "
        f"{args.layer_blocks} per run), per block:"
    )
    for kind in kinds:
        t = bench_layer_blocks(kind, args.repeats, args.layer_blocks)
        print(
            f"  {kind:>4}: batched {t['batched_us']:7.2f} us "
            f"(overhead {t['batched_us'] - t['memcpy_us']:6.2f} us over memcpy "
            f"{t['memcpy_us']:.2f} us), unbatched {t['unbatched_us']:7.2f} us "
            f"(overhead {t['unbatched_us'] - t['memcpy_us']:6.2f} us); "
            f"batching = {t['unbatched_us'] / t['batched_us']:.1f}x faster"
        )
    if not is_nixl_available():
        print("  nixl: not installed (pip install nixl==1.5.1)")

    if not args.skip_e2e:
        pk = bench_pe_packing(max(1, args.repeats // 2))
        print(
            "\nPE forward passes, compute only (oracle 1P1D, 6 x 1200-token uncached prompts; "
            "quota on the estimator measured at start-up):"
        )
        for name, r in pk.items():
            print(
                f"  {name:>12}: JCT {r['jct_s']:6.2f} s  mean TTFT {r['ttft_s']:5.2f} s  "
                f"{r['passes']:3.0f} passes  {r['entries_per_pass']:.2f} requests or chunks "
                f"per pass  {r['chunks']:3.0f} chunks"
            )
        base = pk["unbounded"]
        for name in ("quota 300 ms", "cap 256 tok"):
            print(
                f"  {name} vs unbounded: JCT {pk[name]['jct_s'] / base['jct_s']:.2f}x, "
                f"mean TTFT {pk[name]['ttft_s'] / base['ttft_s']:.2f}x"
            )
        e = bench_end_to_end()
        print("\nend to end, I/O-bound 1P2D (tiny model, SNIC 2 MiB/s, 8 agents x 3 turns):")
        for mode, r in e.items():
            utils = " ".join(f"{k[-2:]}:{v:.0%}" for k, v in r.items() if k.startswith("snic"))
            print(
                f"  {mode:>8}: JCT {r['jct_s']:6.2f} s  {r['tokens_per_s']:8,.0f} tokens/s  "
                f"SNIC read util {utils}"
            )
        print(
            f"  dualpath vs basic: {e['basic']['jct_s'] / e['dualpath']['jct_s']:.2f}x JCT; "
            f"oracle vs dualpath: {e['dualpath']['jct_s'] / e['oracle']['jct_s']:.2f}x"
        )


if __name__ == "__main__":
    main()
