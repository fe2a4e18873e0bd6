"""Scheduler parameters: the paper's constants and every [INF] choice, as named fields.

The paper (A.4) sets `alpha` to the tokens a node's storage NIC reads in 3 s and `beta` to the
tokens one GPU processes in 5 s, "profiled in advance"; `derive_scheduler_params` computes both
from the specs and the cost model, and any field can be overridden.

Choices the paper leaves open (digest §5, tagged [INF]) and the defaults taken here:

- `pe_tok_charge` / `de_tok_charge` (what a request adds to `tok`): `PROMPT` (cached + appended
  tokens). `tok` is "the total token count" of unfinished requests, and KV read, attention and
  decode-side KV all scale with the whole prompt, not the miss part. One load charge, in both
  worlds: a request adds `de_tok_charge` to its DE group's load from the moment DE phase 1
  commits it to the group's private queue (`Scheduler.private_tokens`), then to its DE's `tok`
  (the simulator's engine counter; in the runtime the DE node's report, and until the node has
  the request, the scheduler's addition to that report) until it finishes. The runtime used to
  charge the private queue and the undelivered requests with `prompt_tokens` whatever this
  field said; at the default (`PROMPT`) the two are the same, so no result changed. `PROMPT`
  is also what the runtime's engines count in their own reports (a prompt's tokens), so the
  runtime runs only this default (`runtime.scheduler_process.SchedulerConfig` checks it).
- `update_read_q_within_fetch`: `True`. When a fetch knows a request's read path it adds the
  read to the chosen node's `read_q` at once, so one fetch that assigns many requests does not
  keep sending them to a node whose queue it has already filled (the purpose of category 2).
- `assignment_order` (PE first or DE first): `DE_FIRST`. Both paths need the DE before prefill
  (PE step 6 / DE step 1 target it), and binding the DE first lets the PE fetch choose the read
  path and update `read_q` in the same pass. `sched.scheduler.Scheduler` reads this field to
  decide which queue a new request enters first and where a fetch's assignments go next; the
  policies plan the read in whichever fetch comes second (`pe_fetch(de_node_of=...)` or
  `de_group_fetch(pe_node_of=...)`). The simulator runs both orders; the runtime only DE first
  (its PE's task names the DE, so the DE must be bound before the PE fetch answers).
- `hbm_need` (what HBM a DE reserves): `PROMPT_PLUS_GEN`, the KV of the prompt and of every
  token the turn will generate, so an admitted request never needs preemption.
- `r_set_stops_at_first_misfit` (how R is traversed): `True`; R is the FIFO prefix that fits
  the group's total free HBM, matching the FIFO head-only placement loop after it.
- `dual_tie_side` (where the `dual` rule reads when the PE's and the DE's read queues are equal;
  most such ties are two empty queues): `BALANCED` splits the ties between the sides in
  proportion to their nodes (the DE side takes D/(P+D) of them, P and D the prefill and decode
  nodes), by a deterministic counter the stateful `Scheduler` keeps (`path.ReadSideChooser`), so
  that reads that find both queues empty spread over the machines as evenly as the engine choice
  spreads requests (a stateless call decides as the counter's first tie: PE). `PE` sends every
  tie to the prefill side (no extra compute-NIC hop, but it leaves the prefill machines well
  above the mean storage traffic), `DE` to the decode side.
- `rr_read_side` (how the round-robin family, the ablation's "w/o scheduling" steps, picks the
  read side in `dual` mode; the paper puts the path choice in the inter-engine scheduler of its
  "+scheduling" step, §6.1, and does not say how its "+dual-path loading" step picks one):
  `RANDOM` ignores the queues: PE or DE with probability 1/2 each, from a seeded generator the
  `Scheduler` owns (its `seed`; the simulator passes the run's seed), so a run is deterministic
  in its seed; it reproduces the paper's round-robin storage Max/Avg (Fig. 13) and the
  ablation's dual-path step. `QUEUE` uses the same
  shorter-read-queue rule as `dualpath`, so the two balance storage alike. Not a strict
  alternation: PE, DE, PE, ... falls into step with the round-robin engine cursors, and one
  machine of a side then takes most of that side's reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import Enum

from dualpath.core.blocks import DEFAULT_BLOCK_SIZE
from dualpath.core.errors import SpecError
from dualpath.core.hardware import HardwareSpec
from dualpath.core.model import ModelSpec
from dualpath.core.pickling import pickle_by_fields
from dualpath.core.validate import non_negative, non_negative_int, positive, positive_int
from dualpath.sched.cost import CostCoefficients, coefficients_for, prefill_tokens_per_s
from dualpath.sched.types import WaitingRequest


class TokCharge(str, Enum):
    """Tokens a request adds to its engine's `tok` ([INF])."""

    PROMPT = "prompt"
    """cached + appended tokens (default)."""
    PROMPT_PLUS_GEN = "prompt+gen"
    MISS = "miss"
    """appended (uncached) tokens only."""

    def tokens(self, r: WaitingRequest) -> int:
        if self is TokCharge.PROMPT:
            return r.prompt_tokens
        if self is TokCharge.PROMPT_PLUS_GEN:
            return r.prompt_tokens + r.gen_tokens
        return r.miss_tokens


class HbmNeed(str, Enum):
    """HBM a decode engine reserves for a request ([INF])."""

    PROMPT = "prompt"
    PROMPT_PLUS_GEN = "prompt+gen"
    """default: the KV of the prompt and of all generated tokens."""


class AssignmentOrder(str, Enum):
    """Which engine a request is bound to first ([INF])."""

    DE_FIRST = "de-first"
    PE_FIRST = "pe-first"


class TieSide(str, Enum):
    """Where the `dual` read-path rule reads when both read queues are equal ([INF])."""

    PE = "pe"
    """the prefill node's storage NIC."""
    DE = "de"
    BALANCED = "balanced"
    """default: PE or DE in proportion to the sides' node counts, by a deterministic counter (a
    stateless decision, without the counter, takes a fresh counter's first tie: PE)."""


class RRReadSide(str, Enum):
    """How the round-robin scheduler family picks a request's read side in `dual` mode ([INF])."""

    QUEUE = "queue"
    """the shorter read queue (ties: `dual_tie_side`), as the dualpath scheduler."""
    RANDOM = "random"
    """default: PE or DE with probability 1/2 each (a seeded generator), ignoring the queues."""


class PathMode(str, Enum):
    """Read-path policy: PE side only (Basic), the shorter queue (paper), or split (ours)."""

    PE = "pe"
    DUAL = "dual"
    SPLIT = "split"


DEFAULT_TIE_SIDE = TieSide.BALANCED
"""`SchedulerParams.dual_tie_side`'s default (every world's, and the CLIs'): neither side is
favoured by construction, a reading of the paper's rule, not a fit (the reproduction report's
Fig. 12 section compares it with ties to PE)."""
DEFAULT_RR_READ_SIDE = RRReadSide.RANDOM
"""`SchedulerParams.rr_read_side`'s default: the round-robin baseline picks the side without the
queues, as the paper's ablation adds queue-aware scheduling only in its last step (a reading of
the paper, not a fit; the reproduction report's Fig. 12 section compares it with the queue
rule)."""

# Paper A.4 constants.
ALPHA_READ_S = 3.0
BETA_PROCESS_S = 5.0
Z_FACTOR = 1.05
COMPUTE_QUOTA_S = 0.3
# Representative turn for beta: the 64K dataset's averages (Table 2: context 32721, append
# 429), the set the online experiments most likely use and Table 1's append length.
REFERENCE_CACHED_TOKENS = 32721
REFERENCE_NEW_TOKENS = 429
REFERENCE_GEN_TOKENS = 176


@dataclass(frozen=True)
class SchedulerParams:
    """Every knob of the inter- and intra-engine policies. Frozen, validated on construction;
    derive with `derive_scheduler_params`, change with `dataclasses.replace`."""

    alpha_tokens: float
    """Short-read-queue threshold: `read_q <= alpha` is category 2 (paper: 3 s of SNIC reads)."""
    beta_tokens: float
    """Unfinished-token limit: `tok > beta` is overloaded (paper: 5 s of one GPU's work)."""
    kv_bytes_per_token: float
    """KV bytes of one token over all layers (HBM need of a request)."""
    z_factor: float = Z_FACTOR
    compute_quota_s: float = COMPUTE_QUOTA_S
    block_size_tokens: int = DEFAULT_BLOCK_SIZE
    path_mode: PathMode = PathMode.DUAL
    pe_tok_charge: TokCharge = TokCharge.PROMPT
    de_tok_charge: TokCharge = TokCharge.PROMPT
    hbm_need: HbmNeed = HbmNeed.PROMPT_PLUS_GEN
    update_read_q_within_fetch: bool = True
    assignment_order: AssignmentOrder = AssignmentOrder.DE_FIRST
    r_set_stops_at_first_misfit: bool = True
    dual_tie_side: TieSide = DEFAULT_TIE_SIDE
    rr_read_side: RRReadSide = DEFAULT_RR_READ_SIDE
    max_seqs_per_decode_engine: int = 0
    """Most sequences one decode engine holds at once (serving systems' "max running
    requests"); 0: no cap, HBM alone limits. Not in the paper."""

    def __post_init__(self) -> None:
        owner = "scheduler"
        non_negative(owner, "alpha_tokens", self.alpha_tokens)
        non_negative(owner, "beta_tokens", self.beta_tokens)
        positive(owner, "kv_bytes_per_token", self.kv_bytes_per_token)
        positive(owner, "z_factor", self.z_factor)
        positive(owner, "compute_quota_s", self.compute_quota_s)
        positive_int(owner, "block_size_tokens", self.block_size_tokens)
        non_negative_int(owner, "max_seqs_per_decode_engine", self.max_seqs_per_decode_engine)
        for name, kind in (
            ("path_mode", PathMode), ("pe_tok_charge", TokCharge), ("de_tok_charge", TokCharge),
            ("hbm_need", HbmNeed), ("assignment_order", AssignmentOrder),
            ("dual_tie_side", TieSide), ("rr_read_side", RRReadSide),
        ):
            value = getattr(self, name)
            if not isinstance(value, kind):
                valid = ", ".join(k.value for k in kind)
                raise SpecError(owner, name, value, f"must be one of {valid}")
        for name in ("update_read_q_within_fetch", "r_set_stops_at_first_misfit"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(owner, name, getattr(self, name), "must be true or false")

    def is_de_full(self, num_seqs: int) -> bool:
        """A decode engine holding `num_seqs` sequences takes no more (the optional cap)."""
        cap = self.max_seqs_per_decode_engine
        return cap > 0 and num_seqs >= cap

    def free_de_slots(self, num_seqs: Iterable[int]) -> int | None:
        """Sequences engines holding `num_seqs` can still take under the cap; None: no cap."""
        cap = self.max_seqs_per_decode_engine
        return sum(max(0, cap - n) for n in num_seqs) if cap > 0 else None

    def hbm_bytes(self, r: WaitingRequest) -> int:
        """HBM a decode engine must reserve for `r` (see `hbm_need`)."""
        tokens = r.prompt_tokens + (r.gen_tokens if self.hbm_need is HbmNeed.PROMPT_PLUS_GEN else 0)
        return int(-(-tokens * self.kv_bytes_per_token // 1))  # ceil: never under-reserve

    def with_overrides(self, **fields: object) -> SchedulerParams:
        """A copy with some fields replaced (validated again)."""
        checked = {name: _checked_override(name, value) for name, value in fields.items()}
        return replace(self, **checked)  # type: ignore[arg-type]


def alpha_tokens_of(storage_nic_bytes_per_s: float, kv_bytes_per_token: float,
                    read_s: float = ALPHA_READ_S) -> float:
    """The alpha rule (paper A.4): a read queue is short while it holds fewer tokens than one
    node's storage NIC reads in `read_s` seconds. Every world derives alpha here (the
    simulator and the runtime from their NIC rates, the vLLM router from `--storage-gbps`)."""
    return storage_nic_bytes_per_s * read_s / kv_bytes_per_token


def derive_alpha_tokens(model: ModelSpec, hw: HardwareSpec, read_s: float = ALPHA_READ_S) -> float:
    """Tokens' worth of KV one node's storage NIC reads in `read_s` seconds."""
    return alpha_tokens_of(hw.storage_nic_bytes_per_s, model.kv_bytes_per_token, read_s)


def derive_beta_tokens(
    model: ModelSpec, hw: HardwareSpec, coeffs: CostCoefficients,
    process_s: float = BETA_PROCESS_S, charge: TokCharge = TokCharge.PROMPT,
    cached_tokens: int = REFERENCE_CACHED_TOKENS, new_tokens: int = REFERENCE_NEW_TOKENS,
    gen_tokens: int = REFERENCE_GEN_TOKENS, compute_quota_s: float = COMPUTE_QUOTA_S,
) -> float:
    """`tok` one GPU works off in `process_s` seconds prefilling the representative turn,
    counted in the same unit `tok` is charged in (`charge`)."""
    prompt = cached_tokens + new_tokens
    requests_per_s = prefill_tokens_per_s(
        model, hw, cached_tokens, new_tokens, coeffs, compute_quota_s
    ) / prompt
    r = WaitingRequest(0, prompt, cached_tokens, gen_tokens)
    return process_s * requests_per_s * charge.tokens(r)


_ENUMS: dict[str, type[Enum]] = {
    "path_mode": PathMode, "pe_tok_charge": TokCharge, "de_tok_charge": TokCharge,
    "hbm_need": HbmNeed, "assignment_order": AssignmentOrder, "dual_tie_side": TieSide,
    "rr_read_side": RRReadSide,
}
_BOOLS = ("update_read_q_within_fetch", "r_set_stops_at_first_misfit")


def _checked_override(name: str, value: object) -> object:
    """An override as its field's type (an enum field also takes its value as a string), or
    a SpecError naming the field: the class may be compiled (`dualpath._compiled`), and a
    compiled class rejects a wrongly typed value with a bare TypeError."""
    known = {f.name for f in dataclasses.fields(SchedulerParams)}
    if name not in known:
        raise SpecError("scheduler", name, value,
                        f"unknown field (known: {', '.join(sorted(known))})")
    kind = _ENUMS.get(name)
    if kind is not None:
        if isinstance(value, kind):
            return value
        try:
            return kind(value)
        except ValueError:
            valid = ", ".join(str(k.value) for k in kind)
            raise SpecError("scheduler", name, value, f"must be one of {valid}") from None
    if name in _BOOLS:
        if not isinstance(value, bool):
            raise SpecError("scheduler", name, value, "must be true or false")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError("scheduler", name, value, "must be a number")
    if name in ("block_size_tokens", "max_seqs_per_decode_engine"):
        if value != int(value):
            raise SpecError("scheduler", name, value, "must be an integer")
        return int(value)
    return value


def derive_scheduler_params(
    model: ModelSpec, hw: HardwareSpec, coeffs: CostCoefficients | None = None,
    **overrides: object,
) -> SchedulerParams:
    """Paper-default parameters for this model and hardware, with the sequence cap of its cost
    coefficients; `overrides` replace any field (an explicit `alpha_tokens` / `beta_tokens`
    skips its derivation)."""
    coeffs = coeffs if coeffs is not None else coefficients_for(model, hw)
    overrides = {name: _checked_override(name, value) for name, value in overrides.items()}
    charge = overrides.get("pe_tok_charge", TokCharge.PROMPT)
    quota = overrides.get("compute_quota_s", COMPUTE_QUOTA_S)
    assert isinstance(charge, TokCharge) and isinstance(quota, int | float)  # checked above
    fields: dict[str, object] = {
        "alpha_tokens": derive_alpha_tokens(model, hw),
        "beta_tokens": derive_beta_tokens(model, hw, coeffs, charge=charge,
                                          compute_quota_s=float(quota)),
        "kv_bytes_per_token": model.kv_bytes_per_token,
        "max_seqs_per_decode_engine": coeffs.max_seqs_per_decode_engine,
    }
    fields.update(overrides)
    return SchedulerParams(**fields)  # type: ignore[arg-type]


# Compiled (mypyc) frozen dataclasses unpickle only by constructor (runtime messages).
pickle_by_fields(SchedulerParams)
