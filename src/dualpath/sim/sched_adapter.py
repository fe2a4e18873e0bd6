"""The simulator's side of the policy contract: a thin adapter around `dualpath.sched`'s one
stateful `Scheduler`.

Every decision (DE group, DE engine, PE engine, read path, forward-batch packing) and every queue
it serves (global, private, PE) lives in `dualpath.sched`; this module only builds the scheduler
the mode asks for (policy family, path mode, block size) and the simulator's forward-batch
packing around `sched.batching`. The simulator's event handlers (`handlers.py`, `_dispatch_de` /
`_dispatch_pe`) turn its engines into reports and apply the decisions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from dualpath.sched import batching
from dualpath.sched.cost import AttentionTimeEstimator, CostCoefficients, CostModelEstimator
from dualpath.sched.params import PathMode, SchedulerParams, derive_scheduler_params
from dualpath.sched.scheduler import Scheduler
from dualpath.sched.types import WaitingRequest

if TYPE_CHECKING:
    from dualpath.sim.config import SimConfig
    from dualpath.sim.state import Req

_NO_QUOTA_S = 1e9


class Policy:
    """The run's `Scheduler` (queues, charges, cursors) and the intra-engine packing."""

    def __init__(self, config: SimConfig, coeffs: CostCoefficients, num_de_groups: int) -> None:
        cl = config.cluster
        base = config.scheduler or derive_scheduler_params(cl.model, cl.engine_hardware, coeffs)
        params: SchedulerParams = base.with_overrides(
            **dict(config.scheduler_overrides),
            path_mode=PathMode(config.mode.paths),
            block_size_tokens=config.params.block_size_tokens,
        )
        self.decode_cap = 0
        """The decode sequence cap the simulator applies at decode admission
        (`SimParams.decode_cap_at` = decode; the scheduler then checks HBM only); 0: none."""
        if config.params.decode_cap_at == "decode":
            self.decode_cap = params.max_seqs_per_decode_engine
            params = params.with_overrides(max_seqs_per_decode_engine=0)
        self.params = params
        self.is_dualpath = not config.mode.is_round_robin
        self.sched = Scheduler(self.params, num_de_groups,
                               is_round_robin=config.mode.is_round_robin,
                               read_nodes=(cl.num_prefill_nodes, cl.num_decode_nodes),
                               seed=config.seed)
        self.max_batch_tokens = config.params.max_batch_tokens
        self.kv_bpt = cl.model.kv_bytes_per_token
        self.estimator: AttentionTimeEstimator = (
            CostModelEstimator(cl.model, cl.engine_hardware, coeffs) if config.step_costs is None
            else config.step_costs)

    def pe_charge(self, r: WaitingRequest) -> int:
        return self.sched.pe_charge(r)

    def de_charge(self, r: WaitingRequest) -> int:
        return self.sched.de_charge(r)

    def pack(
        self, ready: Sequence[Req], hbm_kv_bytes: float, is_layerwise: bool
    ) -> list[tuple[Req, int]]:
        """The next forward batch of one PE: the intra-engine compute quota (dualpath) or a
        token cap (round robin); without layerwise prefill, the batch's whole KV (cached + new)
        must also fit the PE's HBM (at least the head runs)."""
        items = _prefill_items(ready)
        if self.is_dualpath:
            batch = batching.pack_prefill_batch(items, self.params.compute_quota_s, self.estimator)
        else:
            batch = batching.pack_prefill_batch(items, _NO_QUOTA_S, self.estimator,
                                                max_batch_tokens=self.max_batch_tokens)
        out: list[tuple[Req, int]] = []
        used = 0.0
        for req, entry in zip(ready, batch.entries, strict=False):
            if not is_layerwise:
                need = (entry.cached_tokens + entry.num_new_tokens) * self.kv_bpt
                if out and used + need > hbm_kv_bytes:
                    break
                used += need
            out.append((req, entry.num_new_tokens))
        return out


def _prefill_items(ready: Sequence[Req]) -> Iterator[batching.PrefillItem]:
    """Lazily, as the packer stops early (a generator function: mypyc compiles a generator
    expression into a list)."""
    for r in ready:
        yield batching.PrefillItem(r.request_id, r.cached_tokens, r.remaining_tokens)
