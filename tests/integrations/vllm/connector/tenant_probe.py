"""The tenant probe in real vLLM (run by `test_tenants_in_vllm.py` in the vLLM venv): one
instance with DualPathConnector and vLLM's own prefix cache on, a 360-token prompt sent under
cache salt A, then B, then A again after vLLM's prefix cache is emptied (so only the store can
serve it); the same under two tiny LoRA adapters of SmolLM2 made here with random weights.
Prints one line, `TENANT_PROBE` and a JSON object: each request's `num_cached_tokens` and
output tokens, and the store's files."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

PROMPT = [1000 + (37 * i) % 20000 for i in range(360)]
RANK = 8
MARK = "TENANT_PROBE "
"""Starts the result's line (vLLM logs to the same stdout)."""


def make_adapter(model: Path, folder: Path, seed: int) -> Path:
    """A LoRA adapter of q_proj and v_proj for the Llama model at `model`, random weights."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model / "config.json").read_text())
    hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    head_dim = hidden // int(cfg["num_attention_heads"])
    kv_out = int(cfg.get("num_key_value_heads", cfg["num_attention_heads"])) * head_dim
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for i in range(layers):
        for proj, out in (("q_proj", hidden), ("v_proj", kv_out)):
            stem = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            weights[f"{stem}.lora_A.weight"] = torch.randn(RANK, hidden, generator=gen) * 0.05
            weights[f"{stem}.lora_B.weight"] = torch.randn(out, RANK, generator=gen) * 0.05
    folder.mkdir(parents=True)
    save_file(weights, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": str(model)}))
    return folder


def main() -> int:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from dualpath.runtime.model.weights import smollm2_folder

    model = Path(smollm2_folder())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dualpath-tenants-") as tmp:
        store = Path(tmp) / "store"
        adapters = {name: make_adapter(model, Path(tmp) / name, seed)
                    for name, seed in (("x", 1), ("y", 2))}
        llm = LLM(model=str(model), tokenizer=str(model), dtype="float32", enforce_eager=True,
                  enable_prefix_caching=True, max_model_len=1024, max_num_seqs=2, seed=0,
                  enable_lora=True, max_lora_rank=RANK, max_loras=2,
                  kv_transfer_config=KVTransferConfig(
                      kv_connector="DualPathConnector", kv_role="kv_both",
                      kv_connector_module_path=(
                          "dualpath.integrations.vllm.connector.dualpath_connector"),
                      kv_load_failure_policy="recompute",
                      kv_connector_extra_config={"store_path": str(store), "durable": False}))
        params = SamplingParams(temperature=0.0, max_tokens=4)
        loras = {name: LoRARequest(name, i + 1, str(path))
                 for i, (name, path) in enumerate(adapters.items())}

        def send(label: str, salt: str | None = None, lora: str | None = None,
                 reset: bool = False) -> None:
            if reset:
                assert llm.reset_prefix_cache()
            prompt = TokensPrompt(prompt_token_ids=PROMPT)
            if salt is not None:
                prompt["cache_salt"] = salt
            (o,) = llm.generate([prompt], params, use_tqdm=False,
                                lora_request=loras[lora] if lora else None)
            out[label] = {"cached": o.num_cached_tokens, "tokens": list(o.outputs[0].token_ids)}

        send("salt a", "tenant-a")
        send("salt b", "tenant-b")  # vLLM's own cache misses: so must the store
        send("salt a again", "tenant-a", reset=True)  # only the store can serve it
        send("no salt", reset=True)
        send("adapter x", lora="x", reset=True)
        send("adapter y", lora="y", reset=True)  # x's blocks must not serve y
        send("adapter x again", lora="x", reset=True)
        files = list(store.glob("*/*.blk"))
        out["stored_files"] = len(files)
        out["store_modes"] = sorted({oct(p.stat().st_mode & 0o777) for p in files})
    print(MARK + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
