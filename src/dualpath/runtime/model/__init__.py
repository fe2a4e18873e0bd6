"""The runtime's model stack, torch on the CPU (or CUDA when present). Its files, each importing
only those before it (an import-linter `layers` contract):

`gguf` (GGUF reading), `tokenizer` (byte-level BPE, chat templates), `sampling`
(`SamplingParams` and the sampler), `model_config` (a decoder's shape and KV layout),
`kv_cache` (a DE's paged KV), `llama` (the Llama forward, layer by layer), `weights`
(checkpoints, SmolLM2, tiny random models), `model_source` (what a node builds its model from).
"""
