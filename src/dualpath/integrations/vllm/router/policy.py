"""The router's decisions, pure: its accounting of P prefill and D decode vLLM instances and
the one `sched.scheduler.Scheduler` driven from it (no I/O, no clock; `router.Router` moves
the requests).

Cluster shape (`loads.Layout`): every vLLM instance is one engine (a GPU, or one rank of a
data-parallel deployment); the engines of a node share its storage NIC's read queue, and a
node's decode engines are one DE group of the scheduler. By default every instance is a node
of its own. The DE side is scheduled per group as the paper does (phase 1 drains the global
queue to the groups, phase 2 binds one of the group's decode engines). The PE side is fetched
for all prefill engines at once (`PE_GROUP`): a group leader's pull (paper §6.1) has no
equivalent in a router, which sees every instance at every decision, so Algorithm 1 (or round
robin in `basic`) runs over the union of the prefill engines, which spreads requests across
them instead of handing the whole queue to whichever group is asked first.

Loads (`EngineReport` fields), all from the router's own accounting except free KV memory:
- prefill `i`: `num_seqs` / `num_tokens` = requests routed to it whose prefill has not replied
  and their prompt tokens; `read_q_tokens` = hit tokens those requests read on its node's
  PE side.
- decode `j`: `num_seqs` / `num_tokens` = requests bound to it (from the DE fetch until the
  decode reply ends) and their prompt tokens; `read_q_tokens` = hit tokens read on its node's
  DE side by requests whose prefill has not replied; `free_hbm_bytes` from the instance's
  reported or polled metrics (`InstanceMetrics`): KV capacity x (1 - `kv_cache_usage_perc`)
  minus what the requests bound to it but not yet sent to it will need; without a usage
  sample, capacity minus every bound request's need; without a capacity, unlimited
  (admission then never waits on HBM).

A request the scheduler cannot place waits in its queues; `schedule()` is called again when
anything changes (a reply, a failure, a report) and returns the requests it placed. Its cost
does not grow with the number of instances: the loads are sums kept as requests change state
(`loads.Loads`), phase 2 runs for the DE groups that have requests waiting, and Algorithm 1
is given only the prefill engines it could choose (`loads.PrefillIndex`; round robin, whose
turns go through every engine, is given them all).

Instances marked down (`mark_down`: a failed health check or report, a refused connection)
are no candidates: a down prefill instance reports itself overloaded (`tok > beta`, which
Algorithm 1 and round robin both skip), a down decode instance is left out of its group's
fetches, a group whose instances are all down gets no requests in phase 1, and the requests
already waiting on a down decode instance go back to the global queue. Requests it already
holds are the caller's (`requeue` places one again, on the instances up now). `mark_up` makes
it a candidate again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from dualpath.core.errors import SpecError
from dualpath.integrations.vllm.router.loads import Layout, Loads, PrefillIndex, RouteCounters
from dualpath.sched.mode import mode_preset
from dualpath.sched.params import PathMode, SchedulerParams, alpha_tokens_of
from dualpath.sched.scheduler import Scheduler
from dualpath.sched.types import EngineReport, ReadPlan, Role, WaitingRequest

ROUTE_MODES = ("basic", "dualpath", "split")
"""`basic`: PE read path only, round robin; `dualpath`: Algorithm 1, two-level DE scheduling,
the shorter read queue reads; `split`: as dualpath, one request's read split across both."""
PE_GROUP = 0
UNLIMITED_HBM_BYTES = 2**62
"""`free_hbm_bytes` of a decode instance whose KV capacity is unknown."""
DEFAULT_STORAGE_GBPS = 100.0
"""The storage NIC rate alpha is derived from unless `--alpha-tokens` is given."""
DEFAULT_BETA_TOKENS = 262_144
"""Prompt tokens in flight on one prefill instance above which it takes no more (paper: 5 s
of one GPU's work; 256K is about that for an H100-class instance on mostly-cached agent
prompts; set `--beta-tokens` to 5 s of yours)."""


def route_params(mode: str, block_size: int, kv_bytes_per_token: float,
                 alpha_tokens: float | None = None, beta_tokens: float = DEFAULT_BETA_TOKENS,
                 storage_gbps: float = DEFAULT_STORAGE_GBPS) -> tuple[SchedulerParams, bool]:
    """The scheduler parameters of a router mode and whether it schedules round robin.

    alpha defaults to the paper's rule, `sched.params.alpha_tokens_of` (3 s of `storage_gbps`
    reads), beta to `DEFAULT_BETA_TOKENS`; the block size and KV bytes per token come from the
    store's manifest."""
    if mode not in ROUTE_MODES:
        raise SpecError("route", "mode", mode, f"must be one of {', '.join(ROUTE_MODES)}")
    if not storage_gbps > 0:
        raise SpecError("route", "storage_gbps", storage_gbps, "must be > 0")
    switches = mode_preset(mode)
    alpha = alpha_tokens if alpha_tokens is not None else alpha_tokens_of(
        storage_gbps * 1e9 / 8, kv_bytes_per_token)
    params = SchedulerParams(alpha_tokens=alpha, beta_tokens=beta_tokens,
                             kv_bytes_per_token=kv_bytes_per_token, block_size_tokens=block_size,
                             path_mode=PathMode(switches.paths))
    return params, switches.is_round_robin


@dataclass(frozen=True)
class InstanceMetrics:
    """What one poll of a vLLM instance's `/metrics` said (None: absent from the page)."""

    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    """`vllm:kv_cache_usage_perc`, a fraction in [0, 1]."""
    kv_capacity_bytes: int | None = None
    """From `vllm:cache_config_info` (num_gpu_blocks x block_size x KV bytes per token)."""


@dataclass(frozen=True)
class Route:
    """A placed request: its prefill and decode instances (indices) and its read plan."""

    request_id: int
    prefill: int
    decode: int
    plan: ReadPlan

    @property
    def path(self) -> str:
        """"pe", "de", "split" (both sides read) or "none" (no hit)."""
        if self.plan.num_hit_blocks == 0:
            return "none"
        side = self.plan.side
        return side.value if side is not None else "split"


@dataclass
class _Request:
    request: WaitingRequest
    de: tuple[int, int] | None = None
    """(decode instance, HBM bytes) once the DE fetch bound it."""
    route: Route | None = None
    is_prefilled: bool = False
    """The prefill replied: the request is at its decode instance (or finished)."""


class RoutePolicy:
    """The router's `Scheduler` and its accounting; see the module docstring."""

    def __init__(self, params: SchedulerParams, num_prefill: int, num_decode: int,
                 is_round_robin: bool = False,
                 decode_kv_capacity_bytes: int | None = None,
                 forced_read_side: str | None = None, layout: Layout | None = None,
                 is_pruned: bool = True) -> None:
        """`layout`: the instances' nodes (default: one node each); `is_pruned` False gives
        Algorithm 1 every prefill engine at every fetch (the same decisions, at a cost that
        grows with the engines: for checking the pruning)."""
        if num_prefill < 1 or num_decode < 1:
            raise SpecError("route", "instances", (num_prefill, num_decode),
                            "needs at least one prefill and one decode instance")
        if forced_read_side not in (None, "pe", "de"):
            raise SpecError("route", "force_read_side", forced_read_side, "must be pe or de")
        layout = layout or Layout.one_per_node(num_prefill, num_decode)
        if (len(layout.prefill_node), len(layout.decode_node)) != (num_prefill, num_decode):
            raise SpecError("route", "layout", (len(layout.prefill_node),
                                                len(layout.decode_node)),
                            f"must place {num_prefill} prefill and {num_decode} decode "
                            "instances")
        self.forced_read_side = forced_read_side
        """"pe" / "de": every hit is read on that side whatever the policy chose (a
        diagnostic switch, like the runtime's; the placement of engines is unchanged)."""
        self.params = params
        self.num_prefill = num_prefill
        self.num_decode = num_decode
        self.layout = layout
        self.sched = Scheduler(params, layout.num_decode_nodes, is_round_robin=is_round_robin,
                               read_nodes=(layout.num_prefill_nodes, layout.num_decode_nodes))
        self.decode_kv_capacity_bytes = decode_kv_capacity_bytes
        """Overrides every decode instance's reported KV capacity (`--decode-kv-gib`)."""
        self.metrics: dict[tuple[str, int], InstanceMetrics] = {}
        """Latest report or poll per (role, instance index)."""
        self.counters = RouteCounters()
        self._requests: dict[int, _Request] = {}
        self._loads = Loads.empty(layout)
        self._group_of = [layout.group_of(j) for j in range(num_decode)]
        self._decodes_of = layout.decodes_of_group()
        self._is_down = {Role.PREFILL: [False] * num_prefill, Role.DECODE: [False] * num_decode}
        self._num_down_of_group = [0] * layout.num_decode_nodes
        self._pending_groups: set[int] = set()
        """DE groups whose private queue may hold requests (phase 2 runs for these)."""
        self._is_unbind_due = False
        """A decode instance went down: requests bound to it go back to the global queue."""
        self._index: PrefillIndex | None = None if is_round_robin or not is_pruned \
            else PrefillIndex(layout.prefill_node, self._prefill_state)
        if self._index is not None:
            for i in range(num_prefill):
                self._index.touch(i)

    @property
    def down(self) -> set[tuple[str, int]]:
        """(role, instance index) of the instances that take no new requests."""
        return {(role.value, i) for role, flags in self._is_down.items()
                for i, is_down in enumerate(flags) if is_down}

    # -- requests --------------------------------------------------------------------------
    def _share(self, req: _Request, sign: int) -> None:
        """Add (`sign` 1) or take out (-1) what `req` in its present state adds to loads."""
        loads, route = self._loads, req.route
        if route is not None and not req.is_prefilled:
            pe_node = self.layout.prefill_node[route.prefill]
            loads.prefill_seqs[route.prefill] += sign
            loads.prefill_tokens[route.prefill] += sign * self.sched.pe_charge(req.request)
            loads.read_q_tokens[pe_node] += sign * route.plan.pe_read_tokens
            loads.read_q_tokens[self.layout.decode_node[route.decode]] += \
                sign * route.plan.de_read_tokens
            if self._index is not None:
                for i in self._index.engines_of_node[pe_node]:
                    self._index.touch(i)
        if req.de is not None:
            j, need = req.de
            charge = sign * self.sched.de_charge(req.request)
            loads.decode_seqs[j] += sign
            loads.decode_tokens[j] += charge
            loads.group_tokens[self._group_of[j]] += charge
            loads.decode_need_bytes[j] += sign * need
            if not req.is_prefilled:
                loads.decode_unsent_bytes[j] += sign * need

    @contextmanager
    def _changing(self, req: _Request) -> Iterator[None]:
        """`req`'s state changes inside: its share of the loads moves with it."""
        self._share(req, -1)
        try:
            yield
        finally:
            self._share(req, 1)

    def submit(self, request_id: int, prompt_tokens: int, hit_blocks: int,
               gen_tokens: int = 0) -> None:
        """Queue a request (its stored prefix: `hit_blocks` whole blocks); call `schedule`."""
        if request_id in self._requests:
            raise SpecError("route", "request_id", request_id, "submitted twice")
        r = WaitingRequest(request_id, prompt_tokens, hit_blocks * self.params.block_size_tokens,
                           gen_tokens)
        self._requests[request_id] = _Request(r)
        self.sched.submit(r)

    def prefill_done(self, request_id: int) -> None:
        """The prefill instance replied: its seat, and both read queues' share, are free."""
        req = self._requests.get(request_id)
        if req is not None and req.route is not None:
            with self._changing(req):
                req.is_prefilled = True

    def finished(self, request_id: int) -> None:
        """The decode reply ended: forget the request."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._share(req, -1)
            self.counters.num_finished += 1

    def abort(self, request_id: int) -> bool:
        """Drop a request wherever it is (a timeout, an upstream failure, a client gone);
        True if it was still waiting for an instance."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self._share(req, -1)
        self.counters.num_aborted += 1
        return self.sched.cancel(request_id).was_waiting

    def is_known(self, request_id: int) -> bool:
        return request_id in self._requests

    def requeue(self, request_id: int) -> None:
        """Place a request again from the start (its instance failed it before its first
        token): its seats and read-queue shares are given back, it waits in the global queue
        and gets a new route (new instances, a new read plan) from `schedule`."""
        req = self._requests.get(request_id)
        if req is None:
            raise SpecError("route", "request_id", request_id, "unknown (finished or aborted)")
        self.sched.cancel(request_id)
        with self._changing(req):
            req.de, req.route, req.is_prefilled = None, None, False
        self.sched.submit(req.request)
        self.counters.num_requeued += 1

    # -- instances -------------------------------------------------------------------------
    def is_up(self, role: Role, index: int) -> bool:
        return not self._is_down[role][index]

    def mark_down(self, role: Role, index: int) -> None:
        """Instance `index` of `role` takes no new requests (see the module docstring)."""
        self._set_down(role, index, True)

    def mark_up(self, role: Role, index: int) -> None:
        self._set_down(role, index, False)

    def _set_down(self, role: Role, index: int, is_down: bool) -> None:
        flags = self._is_down[role]
        if flags[index] is is_down:
            return
        flags[index] = is_down
        if role is Role.DECODE:
            g = self._group_of[index]
            self._num_down_of_group[g] += 1 if is_down else -1
            self._is_unbind_due |= is_down
            self._pending_groups.add(g)
        elif self._index is not None:
            self._index.touch(index)

    def _is_group_down(self, g: int) -> bool:
        return self._num_down_of_group[g] == len(self._decodes_of[g])

    def _unbind_down_decodes(self) -> None:
        """Requests waiting on a down decode instance (in the private queue of a group whose
        instances are all down, or bound to a down instance and waiting for a prefill
        instance) back to the global queue."""
        sched = self.sched
        for g in range(len(self._decodes_of)):
            if not self._is_group_down(g):
                continue
            while (head := sched.de_head(g)) is not None:
                sched.cancel(head.request_id)
                sched.submit(head)
        if not self._is_unbind_due:
            return
        self._is_unbind_due = False
        down = self._is_down[Role.DECODE]
        for rid, req in self._requests.items():
            if req.route is None and req.de is not None and down[req.de[0]]:
                sched.cancel(rid)
                with self._changing(req):
                    req.de = None
                sched.submit(req.request)

    def update_metrics(self, role: Role, index: int, sample: InstanceMetrics) -> None:
        self.metrics[(role.value, index)] = sample

    # -- decisions -------------------------------------------------------------------------
    def schedule(self) -> list[Route]:
        """DE phase 1 and 2 for every DE group, then one PE fetch over the prefill
        instances; returns the requests placed on both sides now (in placement order)."""
        sched = self.sched
        num_groups = len(self._decodes_of)
        num_down = sum(1 for g in range(num_groups) if self._is_group_down(g)) \
            if any(self._num_down_of_group) else 0
        if num_down or self._is_unbind_due:
            self._unbind_down_decodes()
        # Phase 1 over the groups that are up: a down one's load counts as unlimited; round
        # robin may still hand it a turn, so what lands there goes back and the drain runs
        # again (its cursor moves on: each request lands on a group that is up within one
        # pass over the groups).
        for _ in range(num_groups * max(1, sched.num_global)):
            if not sched.num_global or num_down == num_groups:
                break
            loads = self._loads.group_tokens if not num_down else [
                UNLIMITED_HBM_BYTES if self._is_group_down(g) else t
                for g, t in enumerate(self._loads.group_tokens)]
            self._pending_groups.update(a.group_id for a in sched.drain(loads))
            if not num_down:
                break
            self._unbind_down_decodes()
        read_q = self._loads.read_q_tokens
        for g in sorted(self._pending_groups):
            if not sched.num_private(g):
                self._pending_groups.discard(g)
                continue
            if self._is_group_down(g):
                continue
            reports = [self.decode_report(j) for j in self._decodes_of[g]
                       if self.is_up(Role.DECODE, j)]
            de_fetch = sched.de_fetch(g, reports, read_q)
            for d in de_fetch.assignments:
                req = self._requests[d.request_id]
                with self._changing(req):
                    req.de = (d.engine_id - self.num_prefill, d.hbm_bytes)
            if not sched.num_private(g):
                self._pending_groups.discard(g)
        if not sched.num_pe_waiting:
            return []
        engines = None if self._index is None else \
            self._index.candidates(sched.num_pe_waiting)
        if engines is not None and not engines:
            return []  # every prefill instance is down or overloaded: nothing is placed
        reports = [self.prefill_report(i)
                   for i in (range(self.num_prefill) if engines is None else engines)]
        fetch = sched.pe_fetch(PE_GROUP, reports, read_q)
        placed = []
        for a in fetch.assignments:
            req = self._requests[a.request_id]
            if a.read is None or req.de is None:
                raise RuntimeError(f"request {a.request_id}: placed without its decode instance")
            plan = a.read
            if self.forced_read_side is not None:
                plan = ReadPlan(plan.pe_node_id, plan.de_node_id, plan.num_hit_blocks,
                                plan.num_hit_blocks if self.forced_read_side == "pe" else 0,
                                plan.block_size_tokens)
            route = Route(a.request_id, a.engine_id, req.de[0], plan)
            with self._changing(req):
                req.route = route
            self.counters.requests_by_path[route.path] += 1
            self.counters.blocks_by_side["pe"] += route.plan.num_pe_blocks
            self.counters.blocks_by_side["de"] += route.plan.num_de_blocks
            placed.append(route)
        return placed

    # -- loads -----------------------------------------------------------------------------
    def read_q_by_node(self) -> dict[int, int]:
        """Hit tokens queued on each node's storage NIC: the reads of requests whose prefill
        has not replied (prefill nodes first, then decode nodes: `loads.Layout`)."""
        return dict(self._loads.read_q_tokens)

    def _prefill_state(self, i: int) -> tuple[int, bool, bool]:
        """Prefill instance `i` as Algorithm 1 sorts it: (tok, is its node's read queue
        short, is it a candidate at all: up and not overloaded)."""
        tok = self._loads.prefill_tokens[i]
        p = self.params
        return (tok, self._loads.read_q_tokens[self.layout.prefill_node[i]] <= p.alpha_tokens,
                tok <= p.beta_tokens and not self._is_down[Role.PREFILL][i])

    def prefill_report(self, i: int) -> EngineReport:
        """Prefill instance `i`'s loads; a down one reports more than beta tokens, so neither
        Algorithm 1 nor round robin gives it a request."""
        num, tokens = self._prefill_load(i)
        if self._is_down[Role.PREFILL][i]:
            tokens = max(tokens, int(self.params.beta_tokens) + 1)
        node = self.layout.prefill_node[i]
        return EngineReport(i, node, Role.PREFILL, num, tokens, self._loads.read_q_tokens[node],
                            UNLIMITED_HBM_BYTES)

    def _prefill_load(self, i: int) -> tuple[int, int]:
        """(requests, charged tokens) routed to prefill instance `i` and not yet replied."""
        return self._loads.prefill_seqs[i], self._loads.prefill_tokens[i]

    def decode_report(self, j: int) -> EngineReport:
        node = self.layout.decode_node[j]
        return EngineReport(self.num_prefill + j, node, Role.DECODE, self._loads.decode_seqs[j],
                            self._loads.decode_tokens[j], self._loads.read_q_tokens[node],
                            self.free_hbm_bytes(j))

    def free_hbm_bytes(self, j: int) -> int:
        """Decode instance `j`'s KV memory for new requests (see the module docstring)."""
        sample = self.metrics.get((Role.DECODE.value, j), _NO_METRICS)
        capacity = self.decode_kv_capacity_bytes or sample.kv_capacity_bytes
        if capacity is None:
            return UNLIMITED_HBM_BYTES
        if sample.kv_usage is None:
            return max(0, capacity - self._loads.decode_need_bytes[j])
        unsent = self._loads.decode_unsent_bytes[j]
        return max(0, int(capacity * (1.0 - min(1.0, max(0.0, sample.kv_usage)))) - unsent)

    @property
    def num_waiting(self) -> int:
        """Requests not yet placed on both sides."""
        return self.sched.num_waiting

    def snapshot(self, full_block_bytes: int) -> dict[str, Any]:
        """Every number `/stats` and `/metrics` show (JSON-ready)."""
        read_q = self._loads.read_q_tokens
        c = self.counters
        prefill = []
        for i in range(self.num_prefill):
            num, tokens = self._prefill_load(i)
            node = self.layout.prefill_node[i]
            prefill.append({"index": i, "node": node, "up": self.is_up(Role.PREFILL, i),
                            "in_flight": num, "in_flight_tokens": tokens,
                            "read_queue_tokens": read_q[node],
                            "metrics": _metrics_dict(self.metrics.get(("prefill", i)))})
        decode = []
        for j in range(self.num_decode):
            rep = self.decode_report(j)
            free = rep.free_hbm_bytes
            decode.append({"index": j, "node": rep.node_id, "up": self.is_up(Role.DECODE, j),
                           "in_flight": rep.num_seqs,
                           "in_flight_tokens": rep.num_tokens,
                           "read_queue_tokens": rep.read_q_tokens,
                           "free_kv_bytes": None if free == UNLIMITED_HBM_BYTES else free,
                           "metrics": _metrics_dict(self.metrics.get(("decode", j)))})
        return {
            "waiting": self.num_waiting,
            "requests_by_path": {p: c.requests_by_path[p] for p in ("pe", "de", "split", "none")},
            "hit_blocks_by_side": {s: c.blocks_by_side[s] for s in ("pe", "de")},
            "hit_bytes_by_side": {s: c.blocks_by_side[s] * full_block_bytes for s in ("pe", "de")},
            "finished": c.num_finished, "aborted": c.num_aborted, "requeued": c.num_requeued,
            "prefill": prefill, "decode": decode,
        }


_NO_METRICS = InstanceMetrics()


def _metrics_dict(sample: InstanceMetrics | None) -> dict[str, Any] | None:
    if sample is None:
        return None
    return {"running": sample.running, "waiting": sample.waiting, "kv_usage": sample.kv_usage,
            "kv_capacity_bytes": sample.kv_capacity_bytes}
