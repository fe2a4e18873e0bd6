"""What the connector reads from vLLM's config before it starts: the KV's shape (blocks,
layers, page bytes), the store's files, and the namespace every block key chains from
(`layout_of`). Needs vLLM's config objects, not vllm itself (its types only for mypy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dualpath.integrations.vllm.connector.compat import kv_cache_layout
from dualpath.integrations.vllm.connector.key_namespace import model_identity, namespace_key
from dualpath.integrations.vllm.connector.step_plan import (
    check_blocks_per_file,
    default_blocks_per_file,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

FORMAT_TAG = "dualpath-vllm-v2"
"""Part of every key's namespace: bump when the payload layout or the key derivation changes.
v2 keys every block within its request's scope (cache salt, LoRA adapter, multimodal inputs):
blocks a v1 connector wrote stop matching, since a v1 key did not say which tenant or adapter
computed it."""


@dataclass(frozen=True)
class Layout:
    block_size: int
    layer_names: list[str]
    page_bytes: int
    namespace: bytes
    blocks_per_file: int = 1
    """g: vLLM blocks per store file (`plan`'s "Files")."""

    @property
    def full_block_bytes(self) -> int:
        """One vLLM block's pages of every layer (of this worker's shard)."""
        return len(self.layer_names) * self.page_bytes


def layout_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
              blocks_per_file: object = None) -> Layout:
    """The KV's shape and the key namespace; `blocks_per_file`: the extra config's (None:
    `step_plan.default_blocks_per_file`)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"DualPathConnector supports one KV cache group (full attention), "
                         f"this model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    block_size = int(spec.block_size)
    page_bytes = int(spec.page_size_bytes)
    layer_names = list(groups[0].layer_names)
    g = default_blocks_per_file(block_size) if blocks_per_file is None \
        else check_blocks_per_file(blocks_per_file)
    mc = vllm_config.model_config
    # A file of g blocks is another payload than a block's: g is part of the namespace (not
    # when 1, so stores of a block a file keep their keys).
    namespace = namespace_key(FORMAT_TAG, model_identity(str(mc.model)), str(mc.dtype),
                              block_size, page_bytes, len(layer_names),
                              kv_cache_layout(kv_cache_config),
                              *((f"blocks_per_file={g}",) if g > 1 else ()))
    return Layout(block_size, layer_names, page_bytes, namespace, g)
