"""The scheduler side of `DualPathConnector`, pure: hits, loads and saves in vLLM block terms.

vLLM calls the scheduler-side connector with a request's tokens and block ids; this module
turns those calls into a `StepPlan` per engine step, which travels to the worker inside the
connector metadata. Nothing here touches vllm, torch or the bytes of a block.

Keys: the block keys of `dualpath.core.blocks` (prefix-chained over the token ids, one per full
block of `block_size` tokens), chained from a `namespace` that names the model and the KV
format, so two models never share a key, within the request's `KeyScope` (its cache salt, LoRA
adapter and multimodal inputs, as vLLM's own block hash covers them), so two tenants, adapters
or images never share one either. A request the connector cannot key safely (scope None: e.g.
prompt embeddings) neither loads from nor saves to the store; its P/D transfer, which is its
own KV, still runs. Only full blocks have keys; a partial tail is never stored or loaded.

Files: a store file holds `blocks_per_file` (g) aligned vLLM blocks of a request, file `i` its
blocks `[i * g, (i + 1) * g)`, under the key of its last block (`BlockTransfer.keys`), stored
whole or not at all. A hit counts whole files, saves wait for a file's last block (a request's
last partial file is never saved), and a load whose first (or last) file holds blocks the
request does not take reads it whole and drops those (vLLM's prefix cache ends anywhere). With
16-token blocks, g = 8 makes the files of 128-token blocks; g = 1 is a file per block.

Roles (`Planner.role`): `both` (one instance: the store is the only source and sink), `prefill`
(vLLM `kv_producer`) and `decode` (`kv_consumer`). A request the router sent (its
`kv_transfer_params` hold `RouteParams`) runs DualPath's P/D flow:

- prefill: blocks `[0, pe_blocks)` load from the store (PE read path), blocks
  `[pe_blocks, hit_blocks)` are pulled from the decode instance's staging buffer (DE read path,
  `remote_loads`); when the prompt's prefill completes, the blocks the decode instance lacks are
  pushed to it (`pushes`); nothing is saved to the store (the decode instance persists).
- decode: every prompt token but the last loads from the staging buffer under the request's
  `xfer` (`xfer_loads`); the last is recomputed (vLLM samples from it); full blocks are saved.

A request without `RouteParams` runs as on one instance (store hits, saves).

Hits: `match` reports the stored blocks that follow the locally computed ones (vLLM's own
prefix cache), by the one rule of `core.blocks.hit_blocks` (keyed full blocks, at least one
prompt token computed: vLLM needs a token to sample from), the rule the router counts by.
Saves: every block that this step completes (its last token's KV is computed in this step) is
planned once; when vLLM moves a request's computed tokens back (a block that failed to load is
recomputed, a preempted request restarts), the planned-save mark moves back with it, so
recomputed blocks are saved again (the worker skips those already stored).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from dualpath.core.blocks import (
    NO_SCOPE,
    KeyScope,
    block_key,
    hit_blocks,
    max_hit_blocks,
)
from dualpath.core.errors import SpecError
from dualpath.integrations.vllm.connector.step_plan import (
    BlockTransfer,
    Push,
    RemoteLoad,
    StepPlan,
    XferLoad,
    check_blocks_per_file,
)
from dualpath.integrations.vllm.manifest import LOADS_KEY, PARAMS_KEY, LoadReport, RouteParams

ROLES = ("both", "prefill", "decode")

log = logging.getLogger(__name__)


@dataclass
class _Request:
    tokens: Sequence[int]
    """A live view of the request's tokens (vLLM appends outputs to it)."""
    block_ids: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    """Keys of the first `len(keys)` blocks (computed as the request grows)."""
    scope: KeyScope | None = NO_SCOPE
    """What the request's KV depends on besides its tokens; None: it cannot be keyed safely,
    and never touches the store."""
    num_saved: int = 0
    """Blocks below this index were planned for saving (or found stored)."""
    num_prompt_tokens: int = 0
    route: RouteParams | None = None
    pushed: bool = False
    load_issued: bool = False
    """Prefill: the router's hit was handed to a background load once."""
    loads: dict[int, tuple[int, str]] = field(default_factory=dict)
    """Prefill: vLLM block id -> (block index, read side "pe" / "de") of each planned load."""
    first_failed: int | None = None
    """Prefill: the first block index whose load failed (vLLM recomputes from there on)."""
    staged: tuple[int, int] = (0, 0)
    """Prefill: blocks `[a, b)` the decode instance stages for this request (its DE-side
    load), the only ones the push leaves out: blocks vLLM's own prefix cache had here (below
    the load's first) were never staged there."""


@dataclass(frozen=True)
class _Match:
    num_computed_tokens: int
    num_hit_tokens: int
    is_xfer: bool = False
    """Decode: the hit is in the staging buffer under the request's `xfer`."""


class Planner:
    """Scheduler-side state of the connector, one per vLLM scheduler."""

    def __init__(self, block_size: int, namespace: bytes,
                 is_stored: Callable[[bytes], bool], role: str = "both",
                 async_loads: bool = False, num_shards: int = 1,
                 blocks_per_file: int = 1) -> None:
        if block_size < 1:
            raise SpecError("vllm connector", "block_size", block_size, "must be >= 1")
        check_blocks_per_file(blocks_per_file)
        self.blocks_per_file = blocks_per_file
        """g: vLLM blocks per store file (see the module's "Files")."""
        if role not in ROLES:
            raise SpecError("vllm connector", "role", role, f"must be one of {', '.join(ROLES)}")
        self.role = role
        self.async_loads = async_loads
        """Prefill with the router's orders: load in the background (see `StepPlan`)."""
        self.block_size = block_size
        self.namespace = namespace
        self.num_shards = num_shards
        """Workers per instance (tensor x pipeline parallel): each holds a shard of a block."""
        self._is_stored = is_stored
        self._requests: dict[str, _Request] = {}
        self._matches: dict[str, _Match] = {}
        self._pending_loads: dict[str, _Match] = {}
        self._plan = StepPlan()

    # -- request lifecycle ------------------------------------------------------------------
    def add_request(self, req_id: str, tokens: Sequence[int],
                    route: RouteParams | None = None,
                    num_prompt_tokens: int | None = None,
                    scope: KeyScope | None = NO_SCOPE) -> None:
        """A new request; `tokens` is a live view that grows with its outputs. `route`: the
        router's orders (ignored on a single instance). `scope`: what its KV depends on
        besides the tokens (None: it cannot be keyed safely; no store loads or saves)."""
        self._requests[req_id] = _Request(
            tokens=tokens, route=route if self.role != "both" else None,
            num_prompt_tokens=len(tokens) if num_prompt_tokens is None else num_prompt_tokens,
            scope=scope)
        limit = self._limit(len(tokens))
        if self.role == "prefill" and route is not None and route.hit_blocks > limit:
            # The router counts by the same rule over the same tokens, so this is a router
            # that disagrees on either; `match` offers no more than the rule allows.
            log.warning("DualPathConnector: request %s: the router's hit_blocks=%d exceeds the "
                        "%d blocks a prompt of %d tokens may hit (core.blocks.hit_blocks)",
                        req_id, route.hit_blocks, limit, len(tokens))

    def finished_params(self, req_id: str) -> dict[str, object] | None:
        """Prefill: the `kv_transfer_params` the router hands to the decode instance (None
        when the request's blocks were not pushed, e.g. it was aborted)."""
        req = self._requests.get(req_id)
        if self.role != "prefill" or req is None or req.route is None or not req.pushed:
            return None
        r = req.route
        params = RouteParams(xfer=r.xfer, de=r.de, hit_blocks=r.hit_blocks,
                             pe_blocks=r.pe_blocks, tokens=req.num_prompt_tokens).to_params()
        params[PARAMS_KEY][LOADS_KEY] = self.load_report(req_id).to_dict()
        return params

    def load_report(self, req_id: str) -> LoadReport:
        """Prefill: what the request's loads gave, per read side (`load_errors` marks the
        failed ones); a request that loaded nothing reports zeros."""
        req = self._requests.get(req_id)
        if req is None:
            return LoadReport(0, 0, 0)
        cut = req.first_failed
        ok = [side for index, side in req.loads.values() if cut is None or index < cut]
        return LoadReport(ok.count("pe"), ok.count("de"), len(req.loads) - len(ok))

    def load_errors(self, block_ids: Iterable[int]) -> list[tuple[str, int, str]]:
        """vLLM's blocks whose load failed (`KVConnectorOutput.invalid_block_ids`): each
        request that loads one recomputes from it on. Returns (request, block index, read
        side) of each failed block found."""
        failed = set(block_ids)
        found: list[tuple[str, int, str]] = []
        if not failed:
            return found
        for req_id, req in self._requests.items():
            hit = [(index, side) for bid, (index, side) in req.loads.items() if bid in failed]
            if hit:
                found += [(req_id, index, side) for index, side in hit]
                first = min(index for index, _ in hit)
                req.first_failed = first if req.first_failed is None else min(
                    first, req.first_failed)
        return found

    def _note(self, req: _Request, transfer: BlockTransfer, side: str) -> BlockTransfer:
        """Record a planned load of `req` for its `LoadReport` (which blocks, from which
        side; on a prefill or single instance, whose loads come from the store); returns
        it."""
        if self.role != "decode":
            for k, bid in enumerate(transfer.block_ids):
                req.loads[bid] = (transfer.first_block + k, side)
        return transfer

    def finish(self, req_id: str) -> None:
        """Forget a finished request (its blocks were saved in the steps that filled them)."""
        self._requests.pop(req_id, None)
        self._matches.pop(req_id, None)
        self._pending_loads.pop(req_id, None)

    def has_request(self, req_id: str) -> bool:
        return req_id in self._requests

    def is_keyed(self, req_id: str) -> bool:
        """Whether the request's blocks have store keys (False: it never touches the store)."""
        req = self._requests.get(req_id)
        return req is not None and req.scope is not None

    # -- hits -------------------------------------------------------------------------------
    def match(self, req_id: str, num_computed_tokens: int) -> int:
        """Tokens beyond `num_computed_tokens` whose KV is stored (block aligned; may be 0).

        Side-effect free apart from caching keys (vLLM may ask several times per request).
        """
        req = self._requests[req_id]
        bs = self.block_size
        limit = self._limit(len(req.tokens))
        local = num_computed_tokens // bs
        route = req.route
        if self.role == "decode" and route is not None and route.tokens == len(req.tokens):
            # Everything but the last prompt token is in the staging buffer under `xfer`.
            hit = max(route.tokens - 1 - num_computed_tokens, 0)
            self._matches[req_id] = _Match(num_computed_tokens, hit, is_xfer=True)
            return hit
        if self.role == "prefill" and route is not None:
            # The router counted the hits by the same rule (checked in `add_request`); a
            # block that vanished since is a load error. Asked again after a background load
            # was issued, that load failed (or the request was preempted): no hit is offered
            # twice, the rest is recomputed.
            end = local if req.load_issued or req.scope is None else max(
                min(self._route(route)[1], limit), local)
        elif req.scope is None:
            end = local
        else:
            end = hit_blocks(self._keys(req, limit), len(req.tokens), self._is_stored, bs,
                             first=local, blocks_per_file=self.blocks_per_file)
        hit = max(end * bs - num_computed_tokens, 0)
        self._matches[req_id] = _Match(num_computed_tokens, hit)
        return hit

    def is_async(self, req_id: str) -> bool:
        """Whether `req_id`'s hit loads in the background (vLLM's `load_kv_async`)."""
        req = self._requests.get(req_id)
        return (self.async_loads and self.role == "prefill" and req is not None
                and req.route is not None)

    def after_alloc(self, req_id: str, num_external_tokens: int,
                    block_ids: Sequence[int] | None = None) -> None:
        """vLLM allocated blocks for the request (`block_ids`: all of them); load
        `num_external_tokens` (now, in the background, when `is_async`; else in the step that
        schedules the request)."""
        if num_external_tokens <= 0:
            self._pending_loads.pop(req_id, None)
            return
        m = self._matches.get(req_id)
        if m is None or m.num_hit_tokens != num_external_tokens:
            raise ValueError(f"{req_id}: vLLM asks to load {num_external_tokens} tokens, "
                             f"the last match found {m.num_hit_tokens if m else 0}")
        if not self.is_async(req_id):
            self._pending_loads[req_id] = m
            return
        if block_ids is None:
            raise ValueError(f"{req_id}: a background load needs the request's block ids")
        req = self._requests[req_id]
        req.block_ids = list(block_ids)
        req.load_issued = True
        route = req.route
        assert route is not None
        bs = self.block_size
        first = m.num_computed_tokens // bs
        stop = first + m.num_hit_tokens // bs
        split = min(max(self._route(route)[0], first), stop)
        if split > first:
            self._plan.async_loads.append(self._note(req, self._transfer(req_id, req, first,
                                                                         split), "pe"))
        if stop > split:
            req.staged = (split, stop)
            self._plan.async_remote_loads.append(RemoteLoad(
                route.xfer, route.de, self._note(req, self._transfer(req_id, req, split, stop),
                                                 "de")))

    # -- steps ------------------------------------------------------------------------------
    def schedule_new(self, req_id: str, block_ids: Sequence[int], num_computed_tokens: int,
                     num_scheduled_tokens: int) -> None:
        """A request scheduled for the first time in this step."""
        req = self._requests[req_id]
        req.block_ids = list(block_ids)
        req.num_saved = 0
        self._schedule(req_id, req, num_computed_tokens, num_scheduled_tokens)

    def schedule_cached(self, req_id: str, new_block_ids: Sequence[int] | None, *,
                        is_resumed: bool, num_computed_tokens: int,
                        num_scheduled_tokens: int) -> None:
        """A request scheduled again (a later prefill chunk, a decode step, a resumption)."""
        req = self._requests.get(req_id)
        if req is None:
            return
        if is_resumed:
            req.block_ids = list(new_block_ids or ())
        elif new_block_ids:
            req.block_ids.extend(new_block_ids)
        self._schedule(req_id, req, num_computed_tokens, num_scheduled_tokens)

    def _schedule(self, req_id: str, req: _Request, num_computed_tokens: int,
                  num_scheduled_tokens: int) -> None:
        bs = self.block_size
        g = self.blocks_per_file
        # Computed tokens moved back (a failed load recomputed, a preemption): save again.
        req.num_saved = min(req.num_saved, num_computed_tokens // bs // g * g)
        route = req.route
        load = self._pending_loads.pop(req_id, None)
        if load is not None:
            first = load.num_computed_tokens // bs
            if load.is_xfer:
                assert route is not None
                stop = -(-(load.num_computed_tokens + load.num_hit_tokens) // bs)
                self._plan.xfer_loads.append(XferLoad(
                    route.xfer, req_id, first, tuple(req.block_ids[first:stop])))
            else:
                stop = first + load.num_hit_tokens // bs
                split = stop
                if self.role == "prefill" and route is not None:
                    split = min(max(self._route(route)[0], first), stop)
                if split > first:
                    self._plan.loads.append(self._note(
                        req, self._transfer(req_id, req, first, split), "pe"))
                if stop > split:
                    assert route is not None
                    req.staged = (split, stop)
                    self._plan.remote_loads.append(RemoteLoad(
                        route.xfer, route.de, self._note(
                            req, self._transfer(req_id, req, split, stop), "de")))
        end = num_computed_tokens + num_scheduled_tokens
        if self.role == "prefill" and route is not None:
            # No saves (the decode instance persists); once the prompt is computed, push
            # (again, after vLLM moved the computed tokens back to recompute a failed load).
            if req.pushed and num_computed_tokens < req.num_prompt_tokens:
                req.pushed = False
            if not req.pushed and end >= req.num_prompt_tokens:
                total = -(-req.num_prompt_tokens // bs)
                own = range(min(req.staged[0], total), min(req.staged[1], total))
                indices = tuple(i for i in range(total) if i not in own)
                self._plan.pushes.append(Push(
                    route.xfer, route.de, req_id, indices, tuple(req.block_ids[:total]),
                    own.stop))
                req.pushed = True
            return
        if req.scope is None:
            return  # no key: never written where another request could find it
        # Blocks whose every token's KV exists after this step (and whose tokens are known),
        # in whole files: a file is saved once its last block is done, never torn.
        done = min(end // bs, len(req.tokens) // bs, len(req.block_ids)) // g * g
        if load is not None and self.num_shards > 1:
            # A load that fails on one rank only corrupts every rank's KV computed in this
            # step (attention outputs are summed across ranks), and the other ranks cannot
            # know. So a loading step saves nothing of the request; the next step that
            # schedules it saves these blocks, or vLLM has rewound them to recompute.
            return
        if done > req.num_saved:
            self._plan.saves.append(self._transfer(req_id, req, req.num_saved, done))
            req.num_saved = done

    def take_plan(self) -> StepPlan:
        """This step's plan; the next step starts empty."""
        plan, self._plan = self._plan, StepPlan()
        return plan

    # -- keys and files ---------------------------------------------------------------------
    def _limit(self, num_prompt_tokens: int) -> int:
        """The most blocks a prompt may hit: whole files (`core.blocks.hit_blocks`)."""
        g = self.blocks_per_file
        return max_hit_blocks(num_prompt_tokens, self.block_size * g) * g

    def _route(self, route: RouteParams) -> tuple[int, int]:
        """The router's (pe_blocks, hit_blocks) at file edges: the hit down (the router
        counts whole files by the same rule, so this changes nothing unless it disagrees),
        the PE/DE split up, so that each side reads whole files and no file twice."""
        g = self.blocks_per_file
        hit = route.hit_blocks // g * g
        return min(-(-route.pe_blocks // g) * g, hit), hit

    def _keys(self, req: _Request, num_blocks: int) -> list[bytes]:
        """The request's first `num_blocks` keys (`core.blocks.block_keys` within its scope,
        computed once as the request grows)."""
        bs = self.block_size
        scope = req.scope
        if scope is None:
            raise ValueError("a request without a key scope has no store keys")
        while len(req.keys) < num_blocks:
            i = len(req.keys)
            parent = req.keys[-1] if req.keys else scope.namespace(self.namespace)
            extra = scope.block_extra(i * bs, (i + 1) * bs) if scope.media else b""
            req.keys.append(block_key(parent, req.tokens[i * bs : (i + 1) * bs], extra))
        return req.keys

    def _transfer(self, req_id: str, req: _Request, start: int, stop: int) -> BlockTransfer:
        """Blocks `[start, stop)` of the request and the keys of the files holding them
        (`stop` at a file's edge: a file's key is its last block's)."""
        g = self.blocks_per_file
        if stop % g:
            raise ValueError(f"{req_id}: blocks [{start}, {stop}) end inside a file of {g} "
                             "blocks")
        keys = self._keys(req, stop)
        return BlockTransfer(req_id=req_id, first_block=start,
                             block_ids=tuple(req.block_ids[start:stop]),
                             keys=tuple(keys[start // g * g + g - 1:stop:g]),
                             blocks_per_file=g)
