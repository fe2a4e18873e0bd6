"""The runtime world: real processes, real KV bytes, a real model, emulated hardware budgets.

Never imports `dualpath.sim`. Its files, each importing only those before it (an import-linter
`layers` contract; one line each in docs/architecture.md):

- layout:    `kvlayout` (Full / Layer Block bytes; the store itself is `dualpath.store`).
- the model: the `model` subpackage (GGUF reading, tokenizer, sampling, the Llama forward,
             a DE's paged KV, weights, what a node builds its model from).
- transport: `traffic` (rate-limited NIC ports on `dualpath.transport.pacing`), `transfer`
             (the transport's NIXL agent, or shared memory; a node's DRAM pool is a
             `dualpath.transport.slots.SlotPool`), `messages` (typed messages and their queue).
- scheduler: `scheduler_process` (the process around `dualpath.sched`), `estimator` (PE pass
             times).
- a node:    `node_context` (what its threads share), `storage_io` (storage reader / writer),
             `prefill_engine`, `decode_engine`, `node` (its main loop).
- the run:   `run_config`, `emulated_cluster` (scheduler and nodes started and wired; submit,
             cancel, next_message for any driver), `agent_replay` (the agent replay driver,
             `RunResult`).
"""
