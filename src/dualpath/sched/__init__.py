"""dualpath.sched: the paper's scheduler (§6, A.4) as pure policy, plus the GPU cost model.

Snapshot in, decision out: no clocks, threads, sockets, simulator or runtime in here, so the
simulator, the runtime and the vLLM router call the same code. No function changes its inputs;
the state that persists between fetches (queues, their charges, round-robin cursors) lives
once, in `scheduler.Scheduler`, which every world drives through a thin adapter.

Its modules (import names from them; each docstring states its rules and invariants): `types`
(reports, requests, decisions), `params` (`SchedulerParams`, alpha and beta), `mode` (the
presets both worlds run), `pe` (Algorithm 1), `de` (two-level DE scheduling), `path` (the read
path), `scheduler` (the one stateful scheduler), `batching` (intra-engine packing under the
compute quota), `cost` (the GPU cost model), `snapshot` (checks on a group's reports).
"""
