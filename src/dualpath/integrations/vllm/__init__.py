"""DualPath inside vLLM: a KV connector, a router and a launcher for P/D vLLM servers.

Rooms (each a subpackage; only `connector.dualpath_connector` and `connector.vllm_metrics`
import vllm, and `plugin` when vLLM calls it):

- `connector/`  the KV connector that runs inside each vLLM instance: `plan` (scheduler side,
                pure), `worker_side` (worker side: `kvio` paged KV <-> Full Blocks <->
                `BlockStore`; `remote`, `decode_remote`, `async_loader` the P/D data plane),
                `side_channel` (the decode node's staging service), `dualpath_connector`
                (`DualPathConnector`, found by name through `plugin`, or by
                `kv_connector_module_path="dualpath.integrations.vllm.connector.dualpath_connector"`).
- `router/`     `dualpath route`: `policy` (pure decisions around `sched.Scheduler`) and `app`
                (the OpenAI-compatible HTTP front end over prefill and decode instances).
- `cluster/`    `dualpath vllm up`: `spec` (the cluster's settings), `command` (a server's
                command line), `launch` (P/D vLLM servers with the connector on one store,
                supervised), `cpus`, `ports`, `reaper`, `netns` (emulated hosts) and `stock`
                (vLLM's own P/D stack, the baseline).
- `plugin`      vLLM's `vllm.general_plugins` entry point: the connector registered by name.
- `manifest`    the router-connector contract: the store manifest the connectors publish and
                `RouteParams`, the router's `kv_transfer_params`.

`docs/vllm/README.md` has the data flow, the failure handling and the settings.
"""
