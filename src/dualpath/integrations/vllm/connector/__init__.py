"""The DualPath KV connector's code that runs inside a vLLM instance (scheduler and worker side).

Importing this package does not import vllm; `dualpath_connector` does, and so do the modules
that speak vLLM's types for it (`compat`, `scope`, `vllm_metrics`, `paced_fs_tier`). The logic
(`plan` on the scheduler side, `worker_side` and what it drives on the worker side) runs
without vllm.
"""
