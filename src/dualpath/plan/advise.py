"""The P/D advisor: sweep prefill/decode node counts and modes online, find each one's SLO
capacity (`capacity`), and rank them by capacity per GPU with what broke first above it."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from dualpath.core.read_rate import storage_read_model
from dualpath.plan.capacity import (
    MAX_DOUBLINGS,
    MAX_HALVINGS,
    TPOT_SLO_S,
    TTFT_SLO_S,
    OnlinePoint,
    capacities,
    online_duration_s,
)
from dualpath.plan.runner import block_bytes, storage_fraction
from dualpath.plan.section import Context, Section, md_table, write_csv
from dualpath.plan.setups import setup
from dualpath.plan.storage_note import block_size_note


@dataclass(frozen=True)
class Candidate:
    """One (P, D, mode) configuration with its SLO capacity."""

    num_prefill_nodes: int
    num_decode_nodes: int
    mode: str
    capacity_aps: float
    """Highest APS found meeting the SLO (0 if none)."""
    num_gpus: int
    bottleneck: str
    capacity_text: str
    """The capacity as reported: `X`, `>= X` (a lower bound) or `< X` (an upper bound)."""

    @property
    def aps_per_gpu(self) -> float:
        return self.capacity_aps / self.num_gpus

    @property
    def label(self) -> str:
        return f"{self.num_prefill_nodes}P{self.num_decode_nodes}D {self.mode}"


def bottleneck(fail: OnlinePoint | None) -> str:
    """What broke first above capacity: the SLO violated and the largest TTFT part."""
    if fail is None:
        return "no SLO violation found in the searched range"
    if fail.stop_reason == "ttft_limit" or not math.isfinite(fail.ttft_s):
        why = "TTFT (run aborted: a turn waited > 20 s)"
    elif fail.ttft_s > TTFT_SLO_S:
        why = f"TTFT {fail.ttft_s:.1f} s > 4 s"
    elif fail.tpot_s > TPOT_SLO_S:
        return f"decode: TPOT {1e3 * fail.tpot_s:.0f} ms > 50 ms at {fail.aps:.3f} APS"
    else:
        why = "SLO"
    parts = {"queueing for a prefill engine": fail.breakdown_s["queue"],
             "HBM allocation on decode": fail.breakdown_s["allocation"],
             "KV read from storage": fail.breakdown_s["read"],
             "prefill compute": fail.breakdown_s["prefill"]}
    top = max(parts, key=lambda k: parts[k])
    return f"{why} at {fail.aps:.3f} APS; largest TTFT part: {top}"


def storage_words(ctx: Context, setup_name: str) -> str:
    """How the advisor's runs read storage, in one sentence."""
    if ctx.storage_read is None:
        cl = setup(setup_name).cluster()
        if storage_read_model(cl.hardware.name).is_nominal:
            return (f"Storage reads: the line rate ({cl.hardware.name} has no calibrated "
                    "storage record, so this is an upper bound; `--storage-read` models "
                    "yours).")
        note = block_size_note(block_bytes(setup_name), cl.hardware.storage_nic_bytes_per_s,
                               cl.hardware.name)
        return ("Storage reads: the hardware's calibrated record."
                + (f" {note[0].upper()}{note[1:]}." if note else ""))
    return (f"Storage reads (`--storage-read`): {ctx.storage_read.describe()}, "
            f"{storage_fraction(ctx.storage_read, setup_name):.3f} of the line rate for this "
            "model's Full Blocks.")


def advise(
    ctx: Context, setup_name: str, pds: Sequence[tuple[int, int]], modes: Sequence[str],
    steps: int = 2,
) -> tuple[list[Candidate], Section]:
    """Sweep P/D and modes online; rank by SLO capacity per GPU (best first)."""
    started = time.perf_counter()
    s = setup(setup_name)
    hw_g = s.cluster().hardware.gpus_per_node
    cands = []
    found = iter(capacities(ctx, [(setup_name, m, steps, (p, d)) for p, d in pds
                                  for m in modes]))
    for p, d in pds:
        for m in modes:
            cap = next(found)
            fail = next((q for q in cap.points if q.aps == cap.failing_aps), None)
            cands.append(Candidate(p, d, m, cap.passing_aps, (p + d) * hw_g, bottleneck(fail),
                                   cap.text()))
    cands.sort(key=lambda c: -c.aps_per_gpu)
    rows = [[c.label, c.num_gpus, c.capacity_text, f"{1e3 * c.aps_per_gpu:.2f}",
             c.bottleneck] for c in cands]
    csvp = write_csv(ctx.path("advise.csv"),
                     ["config", "gpus", "capacity_aps", "capacity", "aps_per_gpu",
                      "bottleneck"],
                     [[c.label, c.num_gpus, c.capacity_aps, c.capacity_text, c.aps_per_gpu,
                       c.bottleneck] for c in cands])
    best = cands[0]
    runner_up = cands[1] if len(cands) > 1 else None
    dur = online_duration_s(ctx)
    body = (f"{s.label}, trace `{ctx.mals[0] if ctx.mals else '64k'}`, online runs of "
            f"{dur:,.0f} simulated s. Capacity: doubled from a guess while the SLO is met (up "
            f"to {2**MAX_DOUBLINGS}x), halved while it fails (down to 1/{2**MAX_HALVINGS}), then "
            "bisected; `>= X` met the SLO even at the highest APS tried (a lower bound, ranked "
            "by X), `< X` failed even at the lowest. SLO TTFT <= 4 s, "
            f"TPOT <= 50 ms. {storage_words(ctx, setup_name)} "
            f"**Recommended: {best.label}** ({1e3 * best.aps_per_gpu:.2f} mAPS per GPU)"
            + (f"; runner-up {runner_up.label} ({1e3 * runner_up.aps_per_gpu:.2f})."
               if runner_up else ".") + "\n\n"
            + md_table(["config", "GPUs", "capacity APS", "mAPS per GPU", "bottleneck"], rows))
    return cands, Section("advise", f"Advisor: {s.label}", body, (csvp,),
                          time.perf_counter() - started, ctx.scale)
