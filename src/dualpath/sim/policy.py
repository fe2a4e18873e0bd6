"""The simulator's side of the policy contract: snapshots in, `dualpath.sched` decisions out.

Every decision (DE group, DE engine, PE engine, read path, forward-batch packing) is made by
`dualpath.sched`; this module only translates simulator state into its inputs and picks the
policy family the mode asks for (`dualpath` or `round_robin`).
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from dualpath.sched import batching, de, pe
from dualpath.sched.cost import CostCoefficients, CostModelEstimator
from dualpath.sched.params import PathMode, SchedulerParams, derive_scheduler_params
from dualpath.sched.types import EngineReport, PEAssignment, WaitingRequest

if TYPE_CHECKING:
    from dualpath.sim.config import SimConfig
    from dualpath.sim.state import Req

_NO_QUOTA_S = 1e9


class Policy:
    """Policy state the scheduler keeps between fetches: DE private queues, round-robin cursors."""

    def __init__(self, config: SimConfig, coeffs: CostCoefficients) -> None:
        cl = config.cluster
        base = config.scheduler or derive_scheduler_params(cl.model, cl.hardware, coeffs)
        self.params: SchedulerParams = base.with_overrides(
            path_mode=PathMode(config.mode.paths),
            block_size_tokens=config.params.block_size_tokens,
        )
        self.is_dualpath = config.mode.scheduler == "dualpath"
        self.max_batch_tokens = config.params.max_batch_tokens
        self.kv_bpt = cl.model.kv_bytes_per_token
        self.estimator = CostModelEstimator(cl.model, cl.hardware, coeffs)
        self.private: list[deque[Req]] = []
        self.private_tok: list[int] = []
        """Sum of DE charges of each private queue (committed to the group, not yet in tok)."""
        self._rr_group = 0
        self._rr_de: dict[int, int] = {}
        self._rr_pe: dict[int, int] = {}

    def pe_charge(self, r: WaitingRequest) -> int:
        return self.params.pe_tok_charge.tokens(r)

    def de_charge(self, r: WaitingRequest) -> int:
        return self.params.de_tok_charge.tokens(r)

    def de_groups(
        self, queue: list[WaitingRequest], group_tok: list[int]
    ) -> list[tuple[int, int]]:
        """DE phase 1: (request id, group index) for every request of the global queue;
        `group_tok[g]` is the sum of `tok` over group g's engines."""
        while len(self.private) < len(group_tok):
            self.private.append(deque())
            self.private_tok.append(0)
        if self.is_dualpath:
            # A group's load includes the requests already committed to its private queue.
            # (Built in C: this runs on every arrival, over every DE group.)
            loads = list(map(operator.add, group_tok, self.private_tok))
            if len(queue) == 1:
                return [(queue[0].request_id, de.de_least_loaded_group(loads))]
            out = de.de_global_drain(queue, dict(enumerate(loads)), self.params)
        else:
            out, self._rr_group = de.de_global_drain_round_robin(
                queue, list(range(len(group_tok))), self._rr_group
            )
        return [(a.request_id, a.group_id) for a in out]

    def enqueue_private(self, gi: int, req: Req, w: WaitingRequest) -> None:
        self.private[gi].append(req)
        self.private_tok[gi] += self.de_charge(w)

    def pop_private(self, gi: int, w: WaitingRequest) -> Req:
        self.private_tok[gi] -= self.de_charge(w)
        return self.private[gi].popleft()

    def de_fetch(
        self, gi: int, queue: Iterable[WaitingRequest], reports: list[EngineReport]
    ) -> list[tuple[int, int, int]]:
        """DE phase 2 for group `gi`: (request id, engine id, reserved HBM bytes)."""
        if self.is_dualpath:
            fetch = de.de_group_fetch(queue, reports, self.params, is_validated=True)
        else:
            fetch, self._rr_de[gi] = de.de_group_fetch_round_robin(
                queue, reports, self.params, self._rr_de.get(gi, 0), is_validated=True
            )
        return [(a.request_id, a.engine_id, a.hbm_bytes) for a in fetch.assignments]

    def pe_fetch(
        self, gi: int, queue: Iterable[WaitingRequest], reports: list[EngineReport],
        de_node_of: Mapping[int, int], de_read_q: Mapping[int, int],
    ) -> tuple[PEAssignment, ...]:
        """A PE group fetch (Algorithm 1 or round robin), read paths included."""
        if self.is_dualpath:
            return pe.pe_fetch(queue, reports, self.params, de_node_of=de_node_of,
                               read_q_tokens_by_node=de_read_q, is_validated=True).assignments
        fetch, self._rr_pe[gi] = pe.pe_fetch_round_robin(
            queue, reports, self.params, self._rr_pe.get(gi, 0), de_node_of=de_node_of,
            read_q_tokens_by_node=de_read_q, is_validated=True,
        )
        return fetch.assignments

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
        yield batching.PrefillItem(r.rid, r.cached_tokens, r.remaining_tokens)
