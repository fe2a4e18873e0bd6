"""Worlds that put DualPath inside other serving engines (a sibling of `sim` and `runtime`).

- `vllm`  `DualPathConnector`, a vLLM v1 KV connector persisting Full Blocks to a `BlockStore`
          and loading stored prefixes back into vLLM's paged KV cache.
"""
