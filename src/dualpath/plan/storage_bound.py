"""Is a cluster storage-bound on a workload? The turn rate each resource sustains, from the cost
model and the storage read model, with one read path (the prefill side's) and with two.

A steady-state bound, not a simulation. Every resource runs flat out on the workload's turns,
and the cluster's turn rate is the smallest of:

- storage: a turn's hit KV bytes over the storage NICs' effective read rate
  (`core.read_rate`), the prefill nodes' NICs alone (one path) or every node's (two paths,
  DualPath), each capped by the paper's bottleneck-free analysis (`core.analysis`: the compute
  NICs and DRAM that carry the reads);
- prefill: a turn's misses after its hit in engine-seconds (`sched.cost`, turns like it packed
  as the compute quota packs them), over the prefill engines;
- decode: a turn's generated tokens in engine-seconds at the batch a decode engine holds (its
  HBM room or the sequence cap), over the decode engines.

What it leaves out (the simulator has it: `dualpath simulate`): queueing and latency (TTFT,
TPOT), load imbalance, the layerwise overlap of reads with compute, and HBM-bound prefill.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dualpath.core.analysis import analyze
from dualpath.core.cluster import ClusterSpec
from dualpath.core.read_rate import StorageReadModel, storage_read_model
from dualpath.sched import cost as costmod
from dualpath.sched.params import COMPUTE_QUOTA_S

WORTH_GAIN = 1.10
"""DualPath is called worth it where two paths raise the bound by at least this much."""

MAX_SAMPLED_TURNS = 2000
"""The engine times per turn are means over at most this many turns (a seeded uniform sample
of a larger workload); the bytes to read are over every turn."""

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class PathBound:
    """The cluster's turn rate with one read-path setting."""

    name: str
    storage_turns_per_s: float
    turns_per_s: float
    binding: str
    """`storage`, `prefill` or `decode`: the resource that sets `turns_per_s`."""


@dataclass(frozen=True)
class StorageBound:
    """Per-turn work and each resource's turn rate on one cluster and workload."""

    cluster: str
    num_turns: int
    mean_prompt_tokens: float
    mean_hit_tokens: float
    mean_gen_tokens: float
    read_bytes_per_turn: float
    read_bytes_per_s_per_node: float
    """One storage NIC's effective KV read rate for this model's Full Blocks."""
    is_line_rate: bool
    """The storage model reads at the NIC's line rate (no calibrated record): optimistic."""
    prefill_engine_s_per_turn: float
    decode_engine_s_per_turn: float
    mean_decode_batch: float
    prefill_turns_per_s: float
    decode_turns_per_s: float
    one_path: PathBound
    two_paths: PathBound

    @property
    def hit_ratio(self) -> float:
        return self.mean_hit_tokens / self.mean_prompt_tokens

    @property
    def compute_turns_per_s(self) -> float:
        """What the GPUs alone sustain (storage never waited on)."""
        return min(self.prefill_turns_per_s, self.decode_turns_per_s)

    @property
    def gain(self) -> float:
        """Two paths' bound over one path's."""
        return self.two_paths.turns_per_s / self.one_path.turns_per_s

    def storage_wait_share(self, bound: PathBound) -> float:
        """Share of the GPUs' turn rate lost to storage reads with this path setting: what
        part of its time a prefill engine waits for KV rather than computing."""
        return max(0.0, 1.0 - bound.storage_turns_per_s / self.compute_turns_per_s)

    def verdict(self) -> str:
        """Whether DualPath is worth deploying here, in one line."""
        one, two = self.one_path, self.two_paths
        if one.binding == "storage" and self.gain >= WORTH_GAIN:
            return (f"DualPath is worth it here: with one read path the storage NICs cap "
                    f"{self.cluster} at {one.turns_per_s:.3g} turns/s while its GPUs could serve "
                    f"{self.compute_turns_per_s:.3g}; two paths raise the bound to "
                    f"{two.turns_per_s:.3g} ({self.gain:.2f}x, then {two.binding}-bound).")
        if two.binding == "storage":
            return (f"Storage-bound with one or two read paths ({self.gain:.2f}x from "
                    "DualPath): the storage NICs, not their balance, are short; more storage "
                    "bandwidth or fewer GPUs per NIC would help.")
        share = self.compute_turns_per_s / one.storage_turns_per_s
        return (f"DualPath gains little here ({self.gain:.2f}x): one read path "
                + ("nearly " if one.binding == "storage" else "")
                + f"keeps up (the reads need {share:.0%} of the prefill side's storage NICs at "
                f"the GPUs' rate); the bound is the {two.binding} engines.")


def _decode_batch(room_bytes: float, kv_bytes: float, cap: int) -> float:
    b = max(1.0, math.floor(room_bytes / kv_bytes)) if kv_bytes > 0 else 1.0
    return float(min(b, cap)) if cap > 0 else b


def storage_bound(
    cluster: ClusterSpec, prompt_tokens: IntArray, hit_tokens: IntArray, gen_tokens: IntArray,
    storage: StorageReadModel | None = None, block_size_tokens: int = 64,
    compute_quota_s: float = COMPUTE_QUOTA_S,
) -> StorageBound:
    """The bound of `cluster` on the turns given as arrays (one row per turn); `storage`:
    the storage NICs' read model (None: the hardware's calibrated record)."""
    model, hw = cluster.model, cluster.engine_hardware
    coeffs = costmod.coefficients_for(model, hw)
    prompt = np.asarray(prompt_tokens, dtype=np.float64)
    hit = np.asarray(hit_tokens, dtype=np.float64)
    gen = np.asarray(gen_tokens, dtype=np.float64)
    n = len(prompt)
    kv = model.kv_bytes_per_token

    rm = storage or storage_read_model(hw.name)
    nominal = hw.storage_nic_bytes_per_s
    read_rate = rm.read_bytes_per_s(nominal, kv * block_size_tokens)
    a = analyze(hw, cluster.num_prefill_nodes, cluster.num_decode_nodes)
    one_frac, two_frac = a.read_fractions(read_rate / nominal)
    means = (float(prompt.mean()), float(hit.mean()), float(gen.mean()))
    read_per_turn = means[1] * kv

    if n > MAX_SAMPLED_TURNS:
        rows = np.random.default_rng(0).choice(n, MAX_SAMPLED_TURNS, replace=False)
        prompt, hit, gen = prompt[rows], hit[rows], gen[rows]
    m = len(prompt)
    prefill_s = 0.0
    pairs, counts = np.unique(np.stack([hit, prompt - hit]), axis=1, return_counts=True)
    for cached, new, k in zip(pairs[0].tolist(), pairs[1].tolist(), counts.tolist(),
                              strict=True):
        tok_s = costmod.prefill_tokens_per_s(model, hw, cached, new, coeffs, compute_quota_s)
        prefill_s += k * (cached + new) / tok_s
    prefill_s /= m

    ep = cluster.num_decode_engines if model.is_moe else None
    room = costmod.kv_room_bytes(model, hw, coeffs.hbm_reserve_fraction,
                                 cluster.num_decode_engines)
    decode_s = batch_sum = 0.0
    shapes, counts = np.unique(np.stack([prompt, gen]), axis=1, return_counts=True)
    for p, g, k in zip(shapes[0].tolist(), shapes[1].tolist(), counts.tolist(), strict=True):
        b = _decode_batch(room, kv * (p + g), coeffs.max_seqs_per_decode_engine)
        step = costmod.decode_step_time_s(model, hw, int(b), b * (p + g / 2), coeffs,
                                          num_expert_parallel_engines=ep)
        decode_s += k * g * step / b
        batch_sum += k * b
    decode_s /= m

    prefill_rate = cluster.num_prefill_engines / prefill_s
    decode_rate = cluster.num_decode_engines / decode_s

    def bound(name: str, nodes: int, fraction: float) -> PathBound:
        store = (math.inf if read_per_turn <= 0
                 else nodes * read_rate * fraction / read_per_turn)
        rates = {"storage": store, "prefill": prefill_rate, "decode": decode_rate}
        binding = min(rates, key=lambda k: rates[k])
        return PathBound(name, float(store), float(rates[binding]), binding)

    return StorageBound(
        cluster=cluster.label, num_turns=n, mean_prompt_tokens=means[0],
        mean_hit_tokens=means[1], mean_gen_tokens=means[2],
        read_bytes_per_turn=read_per_turn, read_bytes_per_s_per_node=read_rate,
        is_line_rate=rm.is_nominal, prefill_engine_s_per_turn=prefill_s,
        decode_engine_s_per_turn=decode_s, mean_decode_batch=batch_sum / m,
        prefill_turns_per_s=prefill_rate, decode_turns_per_s=decode_rate,
        one_path=bound("one path (prefill-side reads)", cluster.num_prefill_nodes, one_frac),
        two_paths=bound("two paths (DualPath)", cluster.num_nodes, two_frac),
    )
