"""DualPath inside vLLM (issue #20): a v1 KV connector over the checksummed `BlockStore`.

Module map (only `connector` imports vllm; the others import cleanly without it):

- `plan`      the scheduler side's bookkeeping, pure: prefix-chained keys over a request's
              tokens, the stored-prefix hit, which blocks each step loads and which newly full
              blocks it persists (`StepPlan`).
- `kvio`      the worker side's bytes: one Full Block = every layer's page of one vLLM block,
              gathered from / scattered into the paged KV tensors, read and written through
              `BlockStore` (checksummed, atomic).
- `connector` `DualPathConnector(KVConnectorBase_V1)`, registered with
              `kv_connector_module_path="dualpath.integrations.vllm.connector"`.

Step 1 is the PE read path on one instance: storage -> this engine's paged KV, layer by
layer. The DE read path (storage -> decode-node DRAM -> RDMA -> prefill engine) and P/D
instances are next; `docs/vllm.md` has the status.
"""
