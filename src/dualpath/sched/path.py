"""Read-path choice, once a request has both its PE and its DE (paper §6.1 and future work).

Modes (`PathMode`):
- `pe`: every hit block is read by the PE node's storage NIC (Basic, the PE-only baseline).
- `dual`: the paper's rule: the whole read goes to the side whose node has the shorter read
  queue (ties: `SchedulerParams.dual_tie_side`). Two choices that need memory across requests
  are a `ReadSideChooser`'s, which the stateful `Scheduler` owns: the `balanced` tie rule (ties
  split between the sides in proportion to their node counts) and the round-robin family's
  queue-blind coin (`SchedulerParams.rr_read_side`).
- `split` (ours, the paper's future work): the hit blocks are split so both queues are expected
  to drain at the same time. With read queues `q_p`, `q_d` (tokens), storage-NIC rates `r_p`,
  `r_d` and `h` hit tokens, the PE side takes `x` tokens with
  `(q_p + x) / r_p = (q_d + h - x) / r_d`, i.e. `x = (r_p * (q_d + h) - r_d * q_p) / (r_p + r_d)`,
  clamped to `[0, h]` and rounded to whole blocks. When one queue is already longer than the
  other plus the whole read, the read goes entirely to the shorter side, as `dual` does.

Whatever the mode, every hit block is read exactly once (`ReadPlan` partitions them), and the
chosen sides' `read_q` grow by exactly the tokens they read.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, MutableMapping

from dualpath.core.errors import SpecError
from dualpath.sched.params import PathMode, RRReadSide, SchedulerParams, TieSide
from dualpath.sched.types import ReadPlan, ReadSide


def plan_read(
    mode: PathMode,
    hit_tokens: int,
    pe_node_id: int,
    de_node_id: int,
    pe_read_q_tokens: int,
    de_read_q_tokens: int,
    block_size_tokens: int,
    *,
    tie_side: ReadSide = ReadSide.PE,
    pe_read_bytes_per_s: float = 1.0,
    de_read_bytes_per_s: float = 1.0,
) -> ReadPlan:
    """Where `hit_tokens` (block-aligned; a partial tail block is not stored) are read.

    The two rates only matter in `split` mode and only by their ratio.
    """
    if hit_tokens < 0 or hit_tokens % block_size_tokens:
        raise SpecError("read_plan", "hit_tokens", hit_tokens,
                        f"must be a non-negative multiple of {block_size_tokens}")
    num_blocks = hit_tokens // block_size_tokens
    if mode is PathMode.PE or num_blocks == 0:
        num_pe = num_blocks
    elif mode is PathMode.DUAL:
        if pe_read_q_tokens == de_read_q_tokens:
            num_pe = num_blocks if tie_side is ReadSide.PE else 0
        else:
            num_pe = num_blocks if pe_read_q_tokens < de_read_q_tokens else 0
    else:
        rp, rd = pe_read_bytes_per_s, de_read_bytes_per_s
        x = (rp * (de_read_q_tokens + hit_tokens) - rd * pe_read_q_tokens) / (rp + rd)
        num_pe = min(num_blocks, max(0, round(x / block_size_tokens)))
    return ReadPlan(pe_node_id, de_node_id, num_blocks, num_pe, block_size_tokens)


def choose_read_path(
    mode: PathMode,
    hit_tokens: int,
    pe_node_id: int,
    de_node_id: int,
    read_q_tokens_by_node: MutableMapping[int, int],
    block_size_tokens: int,
    *,
    tie_side: ReadSide = ReadSide.PE,
) -> ReadPlan:
    """Plan the read from the nodes' current queues and add it to them.

    Changes `read_q_tokens_by_node`: the PE node's entry grows by `plan.pe_read_tokens`, the
    DE node's by `plan.de_read_tokens` (a missing node counts as an empty queue).
    """
    plan = plan_read(mode, hit_tokens, pe_node_id, de_node_id,
                     read_q_tokens_by_node.get(pe_node_id, 0),
                     read_q_tokens_by_node.get(de_node_id, 0), block_size_tokens,
                     tie_side=tie_side)
    apply_read_plan(plan, read_q_tokens_by_node)
    return plan


def apply_read_plan(plan: ReadPlan, read_q_tokens_by_node: MutableMapping[int, int]) -> None:
    """Add a planned read to the nodes' read queues (each side by the tokens it reads)."""
    if plan.num_pe_blocks:
        read_q_tokens_by_node[plan.pe_node_id] = (
            read_q_tokens_by_node.get(plan.pe_node_id, 0) + plan.pe_read_tokens
        )
    if plan.num_de_blocks:
        read_q_tokens_by_node[plan.de_node_id] = (
            read_q_tokens_by_node.get(plan.de_node_id, 0) + plan.de_read_tokens
        )


class ReadSideChooser:
    """The side a `dual`-mode read goes to, with the state two of the choices need.

    - Queue rule (the dualpath family; the round-robin one with `rr_read_side` `queue`): the
      side whose node's read queue is shorter;
      on a tie `SchedulerParams.dual_tie_side`: `pe`, `de`, or `balanced`, where a Bresenham
      counter sends the n-th tie to DE exactly when `floor(n * D / (P + D))` grows, so after any
      n ties the DE side has taken `floor(n * D / (P + D))` of them (P, D: `num_pe_nodes`,
      `num_de_nodes`, the nodes whose storage NICs read on each side). No randomness.
    - Queue-blind (`is_queue_blind`: the round-robin family with `rr_read_side` `random`): PE or
      DE with probability 1/2 each from a `random.Random(seed)`, one draw per read with hits.
    """

    def __init__(self, params: SchedulerParams, is_round_robin: bool = False,
                 num_pe_nodes: int = 1, num_de_nodes: int = 1, seed: int = 0) -> None:
        if num_pe_nodes < 1 or num_de_nodes < 1:
            raise SpecError("read_side", "nodes", (num_pe_nodes, num_de_nodes),
                            "needs at least one node on each side")
        self.tie_side = params.dual_tie_side
        self.is_queue_blind = is_round_robin and params.rr_read_side is RRReadSide.RANDOM
        self.num_pe_nodes = num_pe_nodes
        self.num_de_nodes = num_de_nodes
        self.num_ties = 0
        """Ties decided so far (queue rule)."""
        self.num_ties_de = 0
        """Of them, sent to the DE side."""
        self._acc = 0
        self._rng = random.Random(seed)

    def side(self, pe_read_q_tokens: int, de_read_q_tokens: int) -> ReadSide:
        """The side of the next `dual`-mode read with hits (advances the tie counter or the
        generator)."""
        if self.is_queue_blind:
            return ReadSide.DE if self._rng.getrandbits(1) else ReadSide.PE
        if pe_read_q_tokens != de_read_q_tokens:
            return ReadSide.PE if pe_read_q_tokens < de_read_q_tokens else ReadSide.DE
        self.num_ties += 1
        rule = self.tie_side
        if rule is TieSide.PE:
            return ReadSide.PE
        if rule is TieSide.DE:
            self.num_ties_de += 1
            return ReadSide.DE
        self._acc += self.num_de_nodes
        total = self.num_pe_nodes + self.num_de_nodes
        if self._acc >= total:
            self._acc -= total
            self.num_ties_de += 1
            return ReadSide.DE
        return ReadSide.PE


def fixed_tie_side(params: SchedulerParams) -> ReadSide:
    """The tie side of a stateless decision (one request, no `ReadSideChooser`): `dual_tie_side`
    `pe` or `de`; `balanced` decides as a fresh counter's first tie does, PE (the counter's
    first step adds D < P + D)."""
    return ReadSide.DE if params.dual_tie_side is TieSide.DE else ReadSide.PE


def plan_pair_read(
    params: SchedulerParams,
    hit_tokens: int,
    pe_node: int,
    de_node: int,
    decide_q: Mapping[int, int],
    read_q: MutableMapping[int, int],
    sides: ReadSideChooser | None = None,
) -> ReadPlan:
    """Plan the read of a request whose PE and DE nodes are both known: decide on `decide_q`
    (the live queues, or a fetch-start snapshot) and add the read to `read_q`. In `dual` mode
    with `sides` (the `Scheduler`'s), the side is `sides.side(...)`; without it, the queue rule
    with a fixed tie side (`fixed_tie_side`; the round-robin coin is then not used)."""
    qp, qd = decide_q.get(pe_node, 0), decide_q.get(de_node, 0)
    if sides is not None and params.path_mode is PathMode.DUAL and hit_tokens > 0:
        # Decided here, then planned as a tie to that side: the same plan `plan_read` makes.
        side = sides.side(qp, qd)
        plan = plan_read(PathMode.DUAL, hit_tokens, pe_node, de_node, 0, 0,
                         params.block_size_tokens, tie_side=side)
    else:
        is_tie_used = params.path_mode is PathMode.DUAL and hit_tokens > 0
        tie = fixed_tie_side(params) if is_tie_used else ReadSide.PE
        plan = plan_read(params.path_mode, hit_tokens, pe_node, de_node, qp, qd,
                         params.block_size_tokens, tie_side=tie)
    apply_read_plan(plan, read_q)
    return plan
