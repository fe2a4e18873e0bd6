"""The router's accounting, pure: which node each instance is on (`Layout`), what the requests
in flight add to each instance and node (`Loads`), and the prefill engines ordered for
Algorithm 1 (`PrefillIndex`).

Engines and nodes, as the paper has them: an engine is one vLLM instance (a GPU, or one
data-parallel rank of a DP-attention deployment, each with its own API server), and the
engines of a node share its storage NIC (one read queue) and form a group. A node holds
prefill or decode engines, never both. Node ids: prefill nodes `0 .. NP-1`, then decode
nodes `NP .. NP+ND-1`, numbered in the order their first instance is given; decode node
`NP + g` is DE group `g` of the scheduler.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from dualpath.core.errors import SpecError


@dataclass(frozen=True)
class Layout:
    """The node of every instance (see the module docstring)."""

    prefill_node: tuple[int, ...]
    """Node id of prefill instance `i`."""
    decode_node: tuple[int, ...]
    """Node id of decode instance `j`."""

    def __post_init__(self) -> None:
        if set(self.prefill_node) & set(self.decode_node):
            raise SpecError("route", "node", sorted(set(self.prefill_node)
                                                    & set(self.decode_node)),
                            "a node holds prefill or decode instances, not both")
        if sorted(set(self.prefill_node)) != list(range(self.num_prefill_nodes)) or \
                sorted(set(self.decode_node)) != list(range(
                    self.num_prefill_nodes, self.num_prefill_nodes + self.num_decode_nodes)):
            raise SpecError("route", "node", (self.prefill_node, self.decode_node),
                            "node ids must be 0..NP-1 (prefill), then NP..NP+ND-1 (decode)")

    @classmethod
    def one_per_node(cls, num_prefill: int, num_decode: int) -> Layout:
        """Every instance on a node of its own."""
        return cls(tuple(range(num_prefill)), tuple(range(num_prefill,
                                                          num_prefill + num_decode)))

    @classmethod
    def of_names(cls, prefill: Sequence[str], decode: Sequence[str]) -> Layout:
        """From each instance's node name (instances with one name share a node)."""
        both = sorted(set(prefill) & set(decode))
        if both:
            raise SpecError("route", "node", both[0], "holds prefill and decode instances; "
                            "a node holds one role")
        ids: dict[str, int] = {}
        for name in (*prefill, *decode):
            ids.setdefault(name, len(ids))
        return cls(tuple(ids[n] for n in prefill), tuple(ids[n] for n in decode))

    @cached_property
    def num_prefill_nodes(self) -> int:
        return len(set(self.prefill_node))

    @cached_property
    def num_decode_nodes(self) -> int:
        return len(set(self.decode_node))

    def group_of(self, j: int) -> int:
        """The DE group of decode instance `j`."""
        return self.decode_node[j] - self.num_prefill_nodes

    def decodes_of_group(self) -> list[list[int]]:
        """The decode instances of each DE group, in instance order."""
        out: list[list[int]] = [[] for _ in range(self.num_decode_nodes)]
        for j in range(len(self.decode_node)):
            out[self.group_of(j)].append(j)
        return out

    def prefills_of_node(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for i, node in enumerate(self.prefill_node):
            out.setdefault(node, []).append(i)
        return out


@dataclass
class Loads:
    """What the requests add to each instance's and node's report, kept as they change
    state (`RoutePolicy._changing` takes a request's old share out and puts its new one
    in), so a decision reads them in O(1) per engine it looks at."""

    prefill_seqs: list[int]
    prefill_tokens: list[int]
    decode_seqs: list[int]
    decode_tokens: list[int]
    group_tokens: list[int]
    """Sum of `decode_tokens` over each DE group's instances."""
    decode_need_bytes: list[int]
    """HBM bytes of the requests bound to each decode instance."""
    decode_unsent_bytes: list[int]
    """... of those of them whose prefill has not replied."""
    read_q_tokens: dict[int, int]
    """Per node id: hit tokens its storage NIC has queued."""

    @classmethod
    def empty(cls, layout: Layout) -> Loads:
        p, d = len(layout.prefill_node), len(layout.decode_node)
        nodes = layout.num_prefill_nodes + layout.num_decode_nodes
        return cls([0] * p, [0] * p, [0] * d, [0] * d, [0] * layout.num_decode_nodes,
                   [0] * d, [0] * d, dict.fromkeys(range(nodes), 0))


@dataclass
class RouteCounters:
    """Requests per read path and hit blocks per read side since the router started."""

    requests_by_path: Counter[str] = field(default_factory=Counter)
    blocks_by_side: Counter[str] = field(default_factory=Counter)
    num_finished: int = 0
    num_aborted: int = 0
    num_requeued: int = 0
    """Requests placed again after an instance failed them (`requeue`)."""


class PrefillIndex:
    """The prefill engines in Algorithm 1's two categories (short read queue, long read
    queue; overloaded and down engines in neither), each ordered by (`tok`, engine id):
    lazy-deletion heaps, an entry pushed whenever an engine's `tok` or its node's category
    changes (`touch`) and dropped when found stale.

    `candidates` gives a fetch for `q` waiting requests the engines it could choose, so
    `pe.pe_fetch` over them decides exactly as over every engine. Each step of a fetch binds
    one engine (its `tok` grows) and moves at most one node, the chosen engine's, from the
    short category to the long one (a node holds one role, so decode-side reads never move a
    prefill node). So before step `k + 1` at most `k` engines of the short category's first
    `k (E + 1) + 1` (`E`: engines per node at most) have grown or moved: one of them is
    still the short category's minimum, nothing further back is ever chosen, and the long
    category is never asked. When the short category has fewer engines than that, all of
    them are candidates (those that move with them too), and of the long category, whose
    engines never leave, at most `k` of its first `k + 1` have grown."""

    def __init__(self, node_of: Sequence[int],
                 state: Callable[[int], tuple[int, bool, bool]]) -> None:
        """`state(i)`: engine `i`'s (tok, is its node's read queue short, is it eligible:
        up and not overloaded)."""
        self.node_of = list(node_of)
        self.state = state
        self.engines_of_node: dict[int, list[int]] = {}
        for i, node in enumerate(self.node_of):
            self.engines_of_node.setdefault(node, []).append(i)
        self.max_per_node = max(len(v) for v in self.engines_of_node.values())
        self._heaps: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])
        """(long, short) category heaps of (tok, engine)."""

    def touch(self, i: int) -> None:
        """Engine `i`'s state changed: an entry for its present state (none when
        ineligible)."""
        tok, is_short, is_eligible = self.state(i)
        if is_eligible:
            heap = self._heaps[is_short]
            heapq.heappush(heap, (tok, i))
            if len(heap) > 4 * len(self.node_of) + 64:
                heap[:] = sorted({e for e in heap if self.state(e[1]) == (e[0], is_short,
                                                                          True)})

    def _smallest(self, is_short: bool, num: int) -> list[int]:
        """Up to `num` engines of the category, smallest (tok, id) first: stale entries
        (tok, category or eligibility changed since) dropped on the way."""
        heap = self._heaps[is_short]
        found: list[tuple[int, int]] = []
        seen: set[int] = set()
        while heap and len(found) < num:
            tok, i = heapq.heappop(heap)
            if i in seen:
                continue
            if self.state(i) == (tok, is_short, True):
                found.append((tok, i))
                seen.add(i)
        for entry in found:
            heapq.heappush(heap, entry)
        return [i for _, i in found]

    def candidates(self, num_waiting: int) -> list[int] | None:
        """The engines (sorted) a fetch for `num_waiting` requests could choose, or None
        when that bound takes as many as there are (give the fetch every engine)."""
        k = max(0, num_waiting - 1)
        num_short = k * (self.max_per_node + 1) + 1
        if num_short + k + 1 >= len(self.node_of):
            return None
        return sorted({*self._smallest(True, num_short), *self._smallest(False, k + 1)})
