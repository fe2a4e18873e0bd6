"""The runtime world: real processes, real KV bytes, a real model, emulated hardware budgets.

Never imports `dualpath.sim`. Its files, each importing only those before it (an import-linter
`layers` contract; one line each in docs/architecture.md):

- storage:   `kvlayout` (Full / Layer Block bytes), `store` (BlockStore on a filesystem path).
- the model: `gguf` (GGUF reading), `tokenizer`, `sampling`, `model_config`, `kv_cache` (a DE's
             paged KV), `model` (the Llama forward, layer by layer), `weights` (checkpoints,
             SmolLM2, tiny random models), `model_source` (what a node builds its model from).
- transport: `traffic` (rate-limited NIC ports), `buffers` (a node's DRAM pool), `transfer`
             (NIXL or shared memory), `messages` (typed messages and their queue).
- scheduler: `scheduler` (the process around `dualpath.sched`), `estimator` (PE pass times).
- a node:    `node_context` (what its threads share), `storage_io` (storage reader / writer),
             `prefill_engine`, `decode_engine`, `node` (its main loop).
- the run:   `run_config`, `cluster` (scheduler and nodes started and wired; submit, cancel,
             next_message for any driver), `replay` (the agent replay driver, `RunResult`).
"""
