"""dualpath.sched: the paper's scheduler (§6, A.4) as pure policy, plus the GPU cost model.

Snapshot in, decision out: no clocks, threads, sockets, simulator or runtime in here, so the
simulator and the runtime call the same code. No function changes its inputs; the state
that persists between fetches (queues, their charges, round-robin cursors) lives once, in
`scheduler.Scheduler`, which every world drives through a thin adapter.

API (see each module's docstring for the rules and invariants):

- types: `EngineReport(engine_id, node_id, role, num_seqs, num_tokens, read_q_tokens,
  free_hbm_bytes)`, `EngineGroup`, `groups_of_nodes(role, node_ids, engines_per_node,
  nodes_per_group)`, `WaitingRequest(request_id, prompt_tokens, hit_tokens, gen_tokens)`;
  decisions `PEFetch`/`PEAssignment`, `GroupAssignment`, `DEFetch`/`DEAssignment`, `ReadPlan`.
- scheduler: `Scheduler(params, num_de_groups, is_round_robin)`, the one stateful scheduler
  both worlds drive (global, private and PE queues, charges, cursors): `submit`, `drain`,
  `de_fetch`, `pe_fetch`, `cancel`, each returning a decision (`Stage`, `GroupAssignment`s,
  `DEFetch`, `PEFetch`, `Cancelled`).
- mode: `Mode` (layerwise, paths, scheduler, io), `MODE_PRESETS`, `mode_preset(name)`.
- params: `derive_scheduler_params(model, hw, coeffs=None, **overrides) -> SchedulerParams`
  (alpha = 3 s of storage-NIC reads, beta = 5 s of one GPU's prefill, Z factor 1.05, quota
  300 ms, and every [INF] choice as a named field).
- PE (Algorithm 1): `pe_fetch(queue, reports, params, *, de_node_of=None,
  read_q_tokens_by_node=None) -> PEFetch`; baseline `pe_fetch_round_robin(..., start) ->
  (PEFetch, next_start)`.
- DE: `de_global_drain(queue, group_load_tokens, params) -> tuple[GroupAssignment, ...]`,
  `de_group_fetch(private_queue, reports, params, *, pe_node_of=None,
  read_q_tokens_by_node=None) -> DEFetch`; baselines `de_global_drain_round_robin`,
  `de_group_fetch_round_robin`.
- read path: `plan_read(mode, hit_tokens, pe_node, de_node, pe_q, de_q, block_size) ->
  ReadPlan`, `choose_read_path(mode, hit_tokens, pe_node, de_node, read_q_by_node,
  block_size)` (also adds the read to the queues), modes `PathMode.PE | DUAL | SPLIT`.
- intra-engine: `pack_prefill_batch(queue_of_PrefillItem, quota_s, estimator) ->
  PrefillBatch` (FIFO, chunked prefill by binary search).
- cost: `CostCoefficients`, `load_cost_coefficients(model, hw, path=None)`,
  `coefficients_for(model_spec, hw_spec)`, `prefill_attention_time_s(model, hw, pairs,
  coeffs)`, `prefill_ffn_time_s(model, hw, num_tokens, coeffs)`, `prefill_step_time_s`,
  `decode_step_time_s(model, hw, batch_size, total_context_tokens, coeffs)`,
  `AttentionTimeEstimator` protocol and its cost-model implementation `CostModelEstimator`.
"""

from dualpath.sched.batching import (
    BatchEntry,
    PrefillBatch,
    PrefillItem,
    largest_fitting_bsz,
    pack_prefill_batch,
)
from dualpath.sched.cost import (
    AttentionTimeEstimator,
    CostCoefficients,
    CostFileError,
    CostModelEstimator,
    batch_attention_time_s,
    coefficients_for,
    decode_step_time_s,
    load_cost_coefficients,
    prefill_attention_time_s,
    prefill_ffn_time_s,
    prefill_step_time_s,
)
from dualpath.sched.de import (
    de_global_drain,
    de_global_drain_round_robin,
    de_group_fetch,
    de_group_fetch_round_robin,
)
from dualpath.sched.mode import MODE_PRESETS, Mode, mode_preset
from dualpath.sched.params import (
    AssignmentOrder,
    HbmNeed,
    PathMode,
    SchedulerParams,
    TokCharge,
    derive_scheduler_params,
)
from dualpath.sched.path import apply_read_plan, choose_read_path, plan_read
from dualpath.sched.pe import pe_fetch, pe_fetch_round_robin
from dualpath.sched.scheduler import Cancelled, Scheduler, Stage
from dualpath.sched.types import (
    DEAssignment,
    DEFetch,
    EngineGroup,
    EngineReport,
    GroupAssignment,
    PEAssignment,
    PEFetch,
    ReadPlan,
    ReadSide,
    Role,
    WaitingRequest,
    groups_of_nodes,
)

__all__ = [
    "MODE_PRESETS",
    "AssignmentOrder",
    "AttentionTimeEstimator",
    "BatchEntry",
    "Cancelled",
    "CostCoefficients",
    "CostFileError",
    "CostModelEstimator",
    "DEAssignment",
    "DEFetch",
    "EngineGroup",
    "EngineReport",
    "GroupAssignment",
    "HbmNeed",
    "Mode",
    "PEAssignment",
    "PEFetch",
    "PathMode",
    "PrefillBatch",
    "PrefillItem",
    "ReadPlan",
    "ReadSide",
    "Role",
    "Scheduler",
    "SchedulerParams",
    "Stage",
    "TokCharge",
    "WaitingRequest",
    "apply_read_plan",
    "batch_attention_time_s",
    "choose_read_path",
    "coefficients_for",
    "de_global_drain",
    "de_global_drain_round_robin",
    "de_group_fetch",
    "de_group_fetch_round_robin",
    "decode_step_time_s",
    "derive_scheduler_params",
    "groups_of_nodes",
    "largest_fitting_bsz",
    "load_cost_coefficients",
    "mode_preset",
    "pack_prefill_batch",
    "pe_fetch",
    "pe_fetch_round_robin",
    "plan_read",
    "prefill_attention_time_s",
    "prefill_ffn_time_s",
    "prefill_step_time_s",
]
