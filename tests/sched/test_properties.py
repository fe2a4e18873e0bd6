"""Property tests over random snapshots: the fast policies agree with literal, quadratic
re-implementations of the paper's rules, and keep their invariants."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.sched.batching import PrefillItem, pack_prefill_batch
from dualpath.sched.de import de_global_drain, de_group_fetch
from dualpath.sched.params import HbmNeed, PathMode, SchedulerParams, TokCharge
from dualpath.sched.path import plan_read
from dualpath.sched.pe import pe_fetch
from dualpath.sched.types import EngineReport, Role, WaitingRequest

BS = 64
EXAMPLES = settings(max_examples=150, deadline=None)


@st.composite
def requests(draw: st.DrawFn, max_size: int = 30) -> list[WaitingRequest]:
    out = []
    for i in range(draw(st.integers(0, max_size))):
        prompt = draw(st.integers(0, 1500))
        hit = draw(st.integers(0, prompt // BS)) * BS
        out.append(WaitingRequest(i, prompt, hit, draw(st.integers(0, 50))))
    return out


@st.composite
def reports(draw: st.DrawFn, role: Role) -> list[EngineReport]:
    num_nodes = draw(st.integers(1, 4))
    per_node = draw(st.integers(1, 3))
    out = []
    for n in range(num_nodes):
        q = draw(st.integers(0, 3000))
        for j in range(per_node):
            out.append(EngineReport(n * per_node + j, n, role, draw(st.integers(0, 5)),
                                    draw(st.integers(0, 3000)), q,
                                    draw(st.integers(0, 4000))))
    return draw(st.permutations(out))


@st.composite
def params(draw: st.DrawFn) -> SchedulerParams:
    return SchedulerParams(
        alpha_tokens=draw(st.integers(0, 3000)),
        beta_tokens=draw(st.integers(0, 4000)),
        kv_bytes_per_token=draw(st.sampled_from([0.5, 1.0, 2.0])),
        path_mode=draw(st.sampled_from(list(PathMode))),
        pe_tok_charge=draw(st.sampled_from(list(TokCharge))),
        de_tok_charge=draw(st.sampled_from(list(TokCharge))),
        hbm_need=draw(st.sampled_from(list(HbmNeed))),
        update_read_q_within_fetch=draw(st.booleans()),
        r_set_stops_at_first_misfit=draw(st.booleans()),
    )


def reference_pe(queue: list[WaitingRequest], reps: list[EngineReport], p: SchedulerParams,
                 de_node_of: dict[int, int], others: dict[int, int]) -> list[tuple[int, int]]:
    """Algorithm 1 as the paper states it, re-evaluating every category at every step."""
    tok = {r.engine_id: r.num_tokens for r in reps}
    node = {r.engine_id: r.node_id for r in reps}
    q = dict(others) | {r.node_id: r.read_q_tokens for r in reps}
    snap = dict(q)
    out = []
    for r in queue:
        view = q if p.update_read_q_within_fetch else snap
        c2 = [e for e in tok if view[node[e]] <= p.alpha_tokens and tok[e] <= p.beta_tokens]
        c3 = [e for e in tok if view[node[e]] > p.alpha_tokens and tok[e] <= p.beta_tokens]
        pool = c2 or c3
        if not pool:
            break
        e = min(pool, key=lambda x: (tok[x], x))
        tok[e] += p.pe_tok_charge.tokens(r)
        if r.request_id in de_node_of:
            d = de_node_of[r.request_id]
            plan = plan_read(p.path_mode, r.hit_tokens, node[e], d, view.get(node[e], 0),
                             view.get(d, 0), BS)
            q[node[e]] = q.get(node[e], 0) + plan.pe_read_tokens
            q[d] = q.get(d, 0) + plan.de_read_tokens
        out.append((r.request_id, e))
    return out


@EXAMPLES
@given(requests(), reports(Role.PREFILL), params(), st.data())
def test_pe_fetch_matches_the_literal_algorithm(
    queue: list[WaitingRequest], reps: list[EngineReport], p: SchedulerParams, data: st.DataObject
) -> None:
    de_node_of = {r.request_id: 100 + data.draw(st.integers(0, 2)) for r in queue
                  if data.draw(st.booleans())}
    others = {100 + i: data.draw(st.integers(0, 3000)) for i in range(3)}
    f = pe_fetch(queue, reps, p, de_node_of=de_node_of, read_q_tokens_by_node=others)
    got = [(a.request_id, a.engine_id) for a in f.assignments]
    assert got == reference_pe(queue, reps, p, de_node_of, others)
    # FIFO prefix; the fetch ends only when the queue is empty or every engine is overloaded.
    assert [a.request_id for a in f.assignments] == [r.request_id for r in queue][: len(got)]
    if len(got) < len(queue):
        tok = {r.engine_id: r.num_tokens for r in reps}
        for r, (_, e) in zip(queue, got, strict=False):
            tok[e] += p.pe_tok_charge.tokens(r)
        assert all(t > p.beta_tokens for t in tok.values())
    # Reads: planned exactly when the DE is known, each conserving the hit blocks.
    total_read = 0
    for r, a in zip(queue, f.assignments, strict=False):
        assert (a.read is not None) == (r.request_id in de_node_of)
        if a.read is not None:
            assert a.read.num_pe_blocks + a.read.num_de_blocks == r.hit_tokens // BS
            total_read += r.hit_tokens
    before = sum((dict(others) | {x.node_id: x.read_q_tokens for x in reps}).values())
    assert sum(f.read_q_tokens_by_node.values()) == before + total_read


def reference_de(queue: list[WaitingRequest], reps: list[EngineReport],
                 p: SchedulerParams) -> tuple[list[tuple[int, int]], float]:
    """Phase 2 as the digest's pseudo-code states it, with a full scan per request."""
    seq = {r.engine_id: r.num_seqs for r in reps}
    tok = {r.engine_id: r.num_tokens for r in reps}
    free = {r.engine_id: r.free_hbm_bytes for r in reps}
    total, len_r = sum(free.values()), 0
    for r in queue:
        if p.hbm_bytes(r) <= total:
            total -= p.hbm_bytes(r)
            len_r += p.de_tok_charge.tokens(r)
        elif p.r_set_stops_at_first_misfit:
            break
    z = p.z_factor * (len_r + sum(tok.values())) / len(reps)
    out = []
    for r in queue:
        need, length = p.hbm_bytes(r), p.de_tok_charge.tokens(r)
        fit = [e for e in free if free[e] >= need]
        if not fit:
            break
        low = [e for e in fit if tok[e] + length <= z]
        e = min(low, key=lambda x: (seq[x], x)) if low else min(fit, key=lambda x: (tok[x], x))
        seq[e] += 1
        tok[e] += length
        free[e] -= need
        out.append((r.request_id, e))
    return out, z


@EXAMPLES
@given(requests(), reports(Role.DECODE), params())
def test_de_group_fetch_matches_the_literal_rule_and_never_oversubscribes(
    queue: list[WaitingRequest], reps: list[EngineReport], p: SchedulerParams
) -> None:
    f = de_group_fetch(queue, reps, p)
    want, z = reference_de(queue, reps, p)
    got = [(a.request_id, a.engine_id) for a in f.assignments]
    assert abs(f.z_threshold_tokens - z) <= 1e-9 * max(1.0, z)
    # The reference may go past the first misfit of R only when the fast path cannot place the
    # head anyway, so both agree on the whole assignment list.
    assert got == want
    free = {r.engine_id: r.free_hbm_bytes for r in reps}
    for a in f.assignments:
        free[a.engine_id] -= a.hbm_bytes
    assert all(v >= 0 for v in free.values())


@EXAMPLES
@given(requests(), st.dictionaries(st.integers(0, 5), st.integers(0, 5000), min_size=1))
def test_global_drain_sends_each_request_to_a_least_loaded_group(
    queue: list[WaitingRequest], loads: dict[int, int]
) -> None:
    p = SchedulerParams(alpha_tokens=0, beta_tokens=0, kv_bytes_per_token=1)
    load = dict(loads)
    for r, a in zip(queue, de_global_drain(queue, loads, p), strict=True):
        assert load[a.group_id] == min(load.values())
        load[a.group_id] += p.de_tok_charge.tokens(r)


@EXAMPLES
@given(st.sampled_from(list(PathMode)), st.integers(0, 200), st.integers(0, 20000),
       st.integers(0, 20000), st.floats(0.1, 10), st.floats(0.1, 10))
def test_every_hit_block_is_read_exactly_once(
    mode: PathMode, blocks: int, q_p: int, q_d: int, r_p: float, r_d: float
) -> None:
    plan = plan_read(mode, blocks * BS, 1, 2, q_p, q_d, BS, pe_read_bytes_per_s=r_p,
                     de_read_bytes_per_s=r_d)
    assert sorted([*plan.pe_blocks, *plan.de_blocks]) == list(range(blocks))
    assert plan.pe_read_tokens + plan.de_read_tokens == blocks * BS
    if mode is PathMode.SPLIT and plan.num_pe_blocks and plan.num_de_blocks:
        # Both sides read: their drain times differ by at most one block's read.
        gap = abs((q_p + plan.pe_read_tokens) / r_p - (q_d + plan.de_read_tokens) / r_d)
        assert gap <= BS / min(r_p, r_d) + 1e-6


@dataclass(frozen=True)
class Affine:
    fixed: float
    per_key: float

    def fixed_time_s(self) -> float:
        return self.fixed

    def pair_time_s(self, cached_tokens: int, new_tokens: int) -> float:
        return self.per_key * new_tokens * (cached_tokens + (new_tokens + 1) / 2)


@EXAMPLES
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 3000)), max_size=20),
       st.floats(0.0, 0.05), st.floats(1e-9, 1e-6), st.floats(0.01, 1.0))
def test_packing_is_a_fifo_prefix_under_quota_with_a_maximal_chunk(
    items: list[tuple[int, int]], fixed: float, per_key: float, quota: float
) -> None:
    est = Affine(fixed, per_key)
    queue = [PrefillItem(i, c, n) for i, (c, n) in enumerate(items)]
    b = pack_prefill_batch(queue, quota, est)
    assert [e.request_id for e in b.entries] == list(range(len(b.entries)))
    assert bool(b.entries) == bool(queue)
    assert all(not e.is_chunk for e in b.entries[:-1])
    for e, item in zip(b.entries, queue, strict=False):
        assert e.cached_tokens == item.cached_tokens
        assert e.num_new_tokens == item.remaining_tokens or e is b.entries[-1]
    forced = len(b.entries) == 1 and b.entries[0].num_new_tokens == 1
    assert b.estimated_attention_s <= quota + 1e-12 or forced
    if b.entries and b.entries[-1].is_chunk and not forced:
        last = b.entries[-1]
        rest = b.estimated_attention_s - est.pair_time_s(last.cached_tokens, last.num_new_tokens)
        assert rest + est.pair_time_s(last.cached_tokens, last.num_new_tokens + 1) > quota
    if len(b.entries) < len(queue) and b.entries and not b.entries[-1].is_chunk:
        nxt = queue[len(b.entries)]
        assert b.estimated_attention_s + est.pair_time_s(nxt.cached_tokens, 1) > quota
