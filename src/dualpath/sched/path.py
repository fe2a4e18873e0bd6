"""Read-path choice, once a request has both its PE and its DE (paper §6.1 and future work).

Modes (`PathMode`):
- `pe`: every hit block is read by the PE node's storage NIC (Basic, the PE-only baseline).
- `dual`: the paper's rule: the whole read goes to the side whose node has the shorter read
  queue (ties: `SchedulerParams.dual_tie_side`).
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

from collections.abc import Mapping, MutableMapping

from dualpath.core.errors import SpecError
from dualpath.sched.params import PathMode, SchedulerParams
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


def plan_pair_read(
    params: SchedulerParams,
    hit_tokens: int,
    pe_node: int,
    de_node: int,
    decide_q: Mapping[int, int],
    read_q: MutableMapping[int, int],
) -> ReadPlan:
    """Plan the read of a request whose PE and DE nodes are both known: decide on `decide_q`
    (the live queues, or a fetch-start snapshot) and add the read to `read_q`."""
    plan = plan_read(params.path_mode, hit_tokens, pe_node, de_node,
                     decide_q.get(pe_node, 0), decide_q.get(de_node, 0),
                     params.block_size_tokens, tie_side=params.dual_tie_side)
    apply_read_plan(plan, read_q)
    return plan
