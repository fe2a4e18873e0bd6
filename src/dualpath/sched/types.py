"""Snapshot and decision types shared by every scheduling policy.

A policy call takes a snapshot (`EngineReport`s of one engine group, a waiting queue of
`WaitingRequest`s) and returns a decision object; it mutates none of its inputs. Everything here
is a small value that nobody mutates; whatever can be derived (a request's miss tokens, an engine
group's total `tok`) is a property, not a stored counter.

The types built on every fetch (reports, requests, plans, assignments, fetch results) are
dataclasses for equality, hashing, `repr`, `fields` and `replace`, but with a written `__init__`
instead of `frozen=True`: under mypyc a dataclass-generated `__init__` runs interpreted, many
times slower than a compiled one, and a sampling profile of a heavy simulation showed building
these types as a sizable share of it. Treat them as frozen all the same.

Paper names (§6.1): `seq_e` -> `EngineReport.num_seqs`, `tok_e` -> `EngineReport.num_tokens`,
`read_q_{n(e)}` -> `EngineReport.read_q_tokens`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from dualpath.core.errors import SpecError
from dualpath.core.pickling import pickle_by_fields


class Role(str, Enum):
    """An engine's role in PD disaggregation; a group and a node hold one role only."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(slots=True, init=False, unsafe_hash=True)
class EngineReport:
    """What one engine reports on its group's fetch (paper §6.1).

    `read_q_tokens` is a node-level value: every engine of a node reports the same one.
    """

    engine_id: int
    node_id: int
    role: Role
    num_seqs: int
    """`seq_e`: requests assigned to this engine that have not completed."""
    num_tokens: int
    """`tok_e`: tokens charged for those requests (see `SchedulerParams.pe_tok_charge`)."""
    read_q_tokens: int
    """`read_q_{n(e)}`: tokens' worth of KV still queued for reading on the node's storage NIC."""
    free_hbm_bytes: int
    """HBM the engine can still give to new requests (the DE fetch's admission limit)."""

    def __init__(self, engine_id: int, node_id: int, role: Role, num_seqs: int, num_tokens: int,
                 read_q_tokens: int, free_hbm_bytes: int) -> None:
        self.engine_id = engine_id
        self.node_id = node_id
        self.role = role
        self.num_seqs = num_seqs
        self.num_tokens = num_tokens
        self.read_q_tokens = read_q_tokens
        self.free_hbm_bytes = free_hbm_bytes
        self.__post_init__()

    def __post_init__(self) -> None:
        # Counters a policy compares against thresholds: a negative one is a caller bug that
        # would silently pass every `<=` test, so fail loudly, naming the field. (One combined
        # test first: reports are built per fetch, the per-field loop only runs on failure.)
        if self.num_seqs >= 0 and self.num_tokens >= 0 and self.read_q_tokens >= 0:
            return
        for name in ("num_seqs", "num_tokens", "read_q_tokens"):
            value = getattr(self, name)
            if value < 0:
                raise SpecError(f"engine[{self.engine_id}]", name, value, "must be >= 0")


@dataclass(frozen=True, slots=True)
class EngineGroup:
    """Engines that fetch together; only the leader talks to the scheduler (§6.1).

    Invariant (checked): whole nodes of one role, no engine twice, leader is a member.
    """

    group_id: int
    role: Role
    engine_ids: tuple[int, ...]
    node_of_engine: Mapping[int, int]
    """node id of every engine of the group."""

    def __post_init__(self) -> None:
        owner = f"group[{self.group_id}]"
        if not self.engine_ids:
            raise SpecError(owner, "engine_ids", self.engine_ids, "must not be empty")
        if len(set(self.engine_ids)) != len(self.engine_ids):
            raise SpecError(owner, "engine_ids", self.engine_ids, "holds an engine twice")
        missing = [e for e in self.engine_ids if e not in self.node_of_engine]
        if missing:
            raise SpecError(owner, "node_of_engine", missing, "engines without a node")

    @property
    def leader_engine_id(self) -> int:
        """Rank 0 of the group, the Leader Engine."""
        return self.engine_ids[0]

    @property
    def node_ids(self) -> tuple[int, ...]:
        """The group's nodes, in first-seen order."""
        return tuple(dict.fromkeys(self.node_of_engine[e] for e in self.engine_ids))


def groups_of_nodes(
    role: Role, node_ids: Sequence[int], engines_per_node: int, nodes_per_group: int,
    first_group_id: int = 0,
) -> tuple[EngineGroup, ...]:
    """Cut `node_ids` into groups of `nodes_per_group` whole nodes (the last may be smaller).

    Engine ids follow `core.cluster`: node n holds engines `n*g .. n*g+g-1`.
    """
    if nodes_per_group < 1:
        raise SpecError("groups", "nodes_per_group", nodes_per_group, "must be an integer >= 1")
    groups = []
    for k, start in enumerate(range(0, len(node_ids), nodes_per_group)):
        nodes = node_ids[start : start + nodes_per_group]
        node_of = {n * engines_per_node + j: n for n in nodes for j in range(engines_per_node)}
        groups.append(EngineGroup(first_group_id + k, role, tuple(node_of), node_of))
    return tuple(groups)


@dataclass(slots=True, init=False, unsafe_hash=True)
class WaitingRequest:
    """One turn waiting to be scheduled. `hit_tokens` is the block-aligned stored prefix."""

    request_id: int
    prompt_tokens: int
    hit_tokens: int
    gen_tokens: int
    """Tokens the turn will generate (known exactly in trace replay)."""

    def __init__(self, request_id: int, prompt_tokens: int, hit_tokens: int,
                 gen_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.hit_tokens = hit_tokens
        self.gen_tokens = gen_tokens
        self.__post_init__()

    def __post_init__(self) -> None:
        # The owner's name is built only for an error (one request per turn: a hot path).
        if self.prompt_tokens < 0:
            raise SpecError(f"request[{self.request_id}]", "prompt_tokens", self.prompt_tokens,
                            "must be >= 0")
        if not 0 <= self.hit_tokens <= self.prompt_tokens:
            raise SpecError(f"request[{self.request_id}]", "hit_tokens", self.hit_tokens,
                            f"must be in [0, {self.prompt_tokens}]")
        if self.gen_tokens < 0:
            raise SpecError(f"request[{self.request_id}]", "gen_tokens", self.gen_tokens,
                            "must be >= 0")

    @property
    def miss_tokens(self) -> int:
        """Prompt tokens whose KV must be computed."""
        return self.prompt_tokens - self.hit_tokens


class ReadSide(str, Enum):
    """Which node's storage NIC reads a request's hit blocks (paper Fig. 4)."""

    PE = "pe"
    DE = "de"


@dataclass(slots=True, init=False, unsafe_hash=True)
class ReadPlan:
    """Where a request's hit blocks are read: blocks `[0, num_pe_blocks)` through the PE
    node's storage NIC, blocks `[num_pe_blocks, num_hit_blocks)` through the DE node's.

    Invariant: every hit block is read exactly once (the two ranges partition the hits).
    """

    pe_node_id: int
    de_node_id: int
    num_hit_blocks: int
    num_pe_blocks: int
    block_size_tokens: int

    def __init__(self, pe_node_id: int, de_node_id: int, num_hit_blocks: int, num_pe_blocks: int,
                 block_size_tokens: int) -> None:
        self.pe_node_id = pe_node_id
        self.de_node_id = de_node_id
        self.num_hit_blocks = num_hit_blocks
        self.num_pe_blocks = num_pe_blocks
        self.block_size_tokens = block_size_tokens
        self.__post_init__()

    def __post_init__(self) -> None:
        if not 0 <= self.num_pe_blocks <= self.num_hit_blocks:
            raise SpecError(
                "read_plan", "num_pe_blocks", self.num_pe_blocks,
                f"must be in [0, {self.num_hit_blocks}]",
            )

    @property
    def num_de_blocks(self) -> int:
        return self.num_hit_blocks - self.num_pe_blocks

    @property
    def pe_blocks(self) -> range:
        """Indices of the hit blocks read on the PE side."""
        return range(0, self.num_pe_blocks)

    @property
    def de_blocks(self) -> range:
        """Indices of the hit blocks read on the DE side."""
        return range(self.num_pe_blocks, self.num_hit_blocks)

    @property
    def pe_read_tokens(self) -> int:
        return self.num_pe_blocks * self.block_size_tokens

    @property
    def de_read_tokens(self) -> int:
        return self.num_de_blocks * self.block_size_tokens

    @property
    def side(self) -> ReadSide | None:
        """The single side reading everything, or None for a split (or an empty) read."""
        if self.num_pe_blocks == self.num_hit_blocks:
            return ReadSide.PE
        if self.num_pe_blocks == 0:
            return ReadSide.DE
        return None


@dataclass(slots=True, init=False, unsafe_hash=True)
class PEAssignment:
    """A request bound to a prefill engine; `read` is set once its DE is known."""

    request_id: int
    engine_id: int
    node_id: int
    read: ReadPlan | None

    def __init__(self, request_id: int, engine_id: int, node_id: int,
                 read: ReadPlan | None) -> None:
        self.request_id = request_id
        self.engine_id = engine_id
        self.node_id = node_id
        self.read = read


@dataclass(slots=True, init=False, unsafe_hash=True)
class PEFetch:
    """Result of one PE group fetch.

    Invariant: `assignments` are the first `len(assignments)` requests of the FIFO queue, in
    order; the caller pops exactly that many.
    """

    assignments: tuple[PEAssignment, ...]
    read_q_tokens_by_node: Mapping[int, int]
    """Read queues by node (the group's reports, the caller's view of other nodes) with every
    read this fetch planned added."""

    def __init__(self, assignments: tuple[PEAssignment, ...],
                 read_q_tokens_by_node: Mapping[int, int]) -> None:
        self.assignments = assignments
        self.read_q_tokens_by_node = read_q_tokens_by_node

    @property
    def num_assigned(self) -> int:
        return len(self.assignments)


@dataclass(slots=True, init=False, unsafe_hash=True)
class GroupAssignment:
    """DE phase 1: a request moved from the global queue to a DE group's private queue."""

    request_id: int
    group_id: int

    def __init__(self, request_id: int, group_id: int) -> None:
        # Written, not `frozen=True`: one per arrival (a frozen dataclass's generated
        # `__init__` runs as interpreted code even in the compiled build).
        self.request_id = request_id
        self.group_id = group_id


@dataclass(slots=True, init=False, unsafe_hash=True)
class DEAssignment:
    """A request bound to a decode engine, which reserves `hbm_bytes` for it."""

    request_id: int
    engine_id: int
    node_id: int
    hbm_bytes: int
    read: ReadPlan | None

    def __init__(self, request_id: int, engine_id: int, node_id: int, hbm_bytes: int,
                 read: ReadPlan | None) -> None:
        self.request_id = request_id
        self.engine_id = engine_id
        self.node_id = node_id
        self.hbm_bytes = hbm_bytes
        self.read = read


@dataclass(slots=True, init=False, unsafe_hash=True)
class DEFetch:
    """Result of one DE group fetch (phase 2).

    Invariant: `assignments` are the first `len(assignments)` requests of the group's private
    queue, in order; no engine's reserved HBM exceeds its reported free HBM.
    """

    assignments: tuple[DEAssignment, ...]
    z_threshold_tokens: float
    """`Z` of this fetch (paper §6.1)."""
    num_r_set: int
    """`|R|`: requests that fit the group's total free HBM, assuming no fragmentation."""
    read_q_tokens_by_node: Mapping[int, int]

    def __init__(self, assignments: tuple[DEAssignment, ...], z_threshold_tokens: float,
                 num_r_set: int, read_q_tokens_by_node: Mapping[int, int]) -> None:
        self.assignments = assignments
        self.z_threshold_tokens = z_threshold_tokens
        self.num_r_set = num_r_set
        self.read_q_tokens_by_node = read_q_tokens_by_node

    @property
    def num_assigned(self) -> int:
        return len(self.assignments)


# Compiled (mypyc) frozen dataclasses unpickle only by constructor (runtime messages).
pickle_by_fields(EngineReport, EngineGroup, WaitingRequest, ReadPlan, PEAssignment, PEFetch,
                 GroupAssignment, DEAssignment, DEFetch)
