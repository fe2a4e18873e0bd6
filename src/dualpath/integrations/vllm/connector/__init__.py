"""The DualPath KV connector's code that runs inside a vLLM instance (scheduler and worker side).

Importing this package does not import vllm; only `dualpath_connector` and its
`vllm_metrics` (the connector's stats, Prometheus metrics and KV events in vLLM's types) do.
"""
