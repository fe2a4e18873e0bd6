"""dualpath's vLLM plugin: `DualPathConnector` registered with vLLM's `KVConnectorFactory` by name.

The wheel declares `register` in the `vllm.general_plugins` entry-point group, which vLLM loads
in every process it starts (API server, engine core, workers) before it builds a connector.
With dualpath installed, `--kv-transfer-config '{"kv_connector": "DualPathConnector", ...}'`
needs no `kv_connector_module_path`; a config that still names the module keeps working (vLLM
prefers the module path).

Nothing is imported at load time but vLLM's factory: the registration is lazy (a module path
and a class name), so a process that never builds a connector never imports torch code of ours.
"""

from __future__ import annotations

CONNECTOR_NAME = "DualPathConnector"
"""The connector's class name, and the `kv_connector` value it is registered under."""
CONNECTOR_MODULE = "dualpath.integrations.vllm.connector.dualpath_connector"
"""The module that defines it (what `kv_connector_module_path` names without the plugin)."""


def register() -> None:
    """Register `DualPathConnector` with vLLM's `KVConnectorFactory`; a no-op when the name is
    already registered (vLLM loads general plugins once per process, and a process may load
    them again: `register` must be idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if is_registered():
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)


def is_registered() -> bool:
    """Whether vLLM's factory knows `DualPathConnector` by name (in this process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # The factory offers no public membership test; `register_connector` raises on a second
    # registration, and catching that would also hide a different error of the same type.
    return CONNECTOR_NAME in KVConnectorFactory._registry
