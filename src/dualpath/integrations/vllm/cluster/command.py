"""The command line of one vLLM server with `DualPathConnector`: its `--kv-transfer-config`,
its arguments, and the `reaper` it runs under. `VllmCluster` runs these, and
`dualpath advise` prints them for real hosts."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from dualpath.integrations.vllm.cluster import reaper
from dualpath.integrations.vllm.cluster.spec import VllmClusterSpec
from dualpath.integrations.vllm.plugin import CONNECTOR_MODULE, CONNECTOR_NAME

CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""ChatML, SmolLM2-Instruct's chat format, for model folders without a template of their own
(the GGUF-converted SmolLM2 folder has no `tokenizer_config.json`)."""


def has_chat_template(model: str) -> bool:
    """Whether an HF-style folder carries a chat template vLLM will find."""
    folder = Path(model)
    if (folder / "chat_template.jinja").exists():
        return True
    config = folder / "tokenizer_config.json"
    with contextlib.suppress(OSError, ValueError):
        return "chat_template" in json.loads(config.read_text(encoding="utf-8"))
    return False


MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def is_moe(model: str) -> bool:
    """Whether an HF-style model folder's `config.json` describes a mixture of experts."""
    with contextlib.suppress(OSError, ValueError):
        config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
        return any(config.get(k) for k in MOE_CONFIG_KEYS)
    return False


def kv_transfer_config(spec: VllmClusterSpec, role: str, side_channel: str | None,
                       event_log: Path | None) -> dict[str, Any]:
    extra: dict[str, Any] = {"store_path": str(spec.store), "durable": spec.durable}
    if event_log is not None:
        extra["event_log"] = str(event_log)
    if spec.storage_read_gbps:
        extra["storage_read_gbps"] = spec.storage_read_gbps
    if spec.blocks_per_file is not None:
        extra["blocks_per_file"] = spec.blocks_per_file
    extra.update(spec.kv_traffic_class.extra_config())
    if role == "decode":
        extra.update(side_channel=side_channel, staging_blocks=spec.staging_blocks)
    else:
        extra["async_loads"] = spec.async_loads
    config: dict[str, Any] = {
        "kv_connector": CONNECTOR_NAME,
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra}
    if spec.connector_by_name:
        del config["kv_connector_module_path"]
    return config


def server_command(spec: VllmClusterSpec, port: int, config: dict[str, Any],
                   chat_template: Path | None = None, host: str = "127.0.0.1",
                   dp_rank: tuple[int, str, int] | None = None) -> list[str]:
    """`dp_rank`: (rank, the rank 0 server's address, the ranks' RPC port) of a server that is
    one data-parallel rank of an instance (`VllmClusterSpec.data_parallel_size`). vLLM runs
    data-parallel ranks only for mixture-of-experts models and refuses the options for others,
    whose ranks are independent servers (as vLLM advises for them)."""
    template = ["--chat-template", str(chat_template)] if chat_template is not None else []
    if dp_rank is not None and is_moe(spec.model):
        rank, address, rpc_port = dp_rank
        template += ["--data-parallel-size", str(spec.data_parallel_size),
                     "--data-parallel-rank", str(rank), "--data-parallel-external-lb",
                     "--data-parallel-address", address,
                     "--data-parallel-rpc-port", str(rpc_port)]
    eager = [] if spec.cuda_graphs else ["--enforce-eager"]
    parallel = ["--tensor-parallel-size", str(spec.tensor_parallel_size)] \
        if spec.tensor_parallel_size > 1 else []
    name = ["--served-model-name", spec.served_model_name] if spec.served_model_name else []
    quota = spec.compute_quota.server_args() \
        if spec.compute_quota is not None and config.get("kv_role") == "kv_producer" else []
    return [spec.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", spec.model, *name, "--tokenizer", spec.model, "--dtype", spec.dtype,
            *eager, *parallel, "--no-enable-prefix-caching", "--seed", "0",
            "--max-model-len", str(spec.max_model_len), "--max-num-seqs", str(spec.max_num_seqs),
            "--host", host, "--port", str(port),
            "--kv-transfer-config", json.dumps(config), *quota, *template, *spec.extra_args]


def reaped_command(cmd: list[str], tag: str, grace_s: float) -> list[str]:
    """`cmd` under a `reaper` of this interpreter (which has dualpath)."""
    return [sys.executable, "-m", reaper.__name__, "--tag", tag, "--parent", str(os.getpid()),
            "--grace", f"{grace_s:g}", "--", *cmd]
