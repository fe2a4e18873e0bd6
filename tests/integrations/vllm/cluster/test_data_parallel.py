"""`VllmClusterSpec(data_parallel_size=N)` (`dualpath vllm up --data-parallel N`) without
vLLM: each instance is N servers, one per data-parallel rank (vLLM's external load balancing),
on ports of their own, one node per instance for the router."""

from __future__ import annotations

import sys
from pathlib import Path

from test_launch import stand_in, whoami  # noqa: F401  (the stand-in server fixture)

from dualpath.integrations.vllm.cluster.launch import VllmCluster
from dualpath.integrations.vllm.cluster.spec import VllmClusterSpec


def test_each_rank_is_a_server_and_an_instance_is_a_node(stand_in: Path) -> None:  # noqa: F811
    # A mixture-of-experts model's config: vLLM runs real data-parallel ranks for it.
    (stand_in / "config.json").write_text('{"num_local_experts": 8}')
    spec = VllmClusterSpec(model=str(stand_in), store=stand_in / "store",
                           python=sys.executable, data_parallel_size=2, startup_timeout_s=60)
    with VllmCluster(spec) as cluster:
        got = [(i.name, i.role, i.node) for i in cluster.instances]
        assert got == [("prefill0-r0", "prefill", "prefill0"),
                       ("prefill0-r1", "prefill", "prefill0"),
                       ("decode0-r0", "decode", "decode0"),
                       ("decode0-r1", "decode", "decode0")]
        assert len({i.port for i in cluster.instances}) == 4
        decode_sides = [i.side_channel for i in cluster.instances if i.role == "decode"]
        assert None not in decode_sides and len(set(decode_sides)) == 2
        rpc = {}
        for inst in cluster.instances:
            argv = whoami(inst.url)["argv"]
            assert argv[argv.index("--data-parallel-size") + 1] == "2"
            assert argv[argv.index("--data-parallel-rank") + 1] == inst.name[-1]
            assert "--data-parallel-external-lb" in argv
            rpc.setdefault(inst.node, set()).add(argv[argv.index("--data-parallel-rpc-port")
                                                      + 1])
        # The ranks of an instance share one RPC port; the two instances do not.
        assert all(len(ports) == 1 for ports in rpc.values())
        assert rpc["prefill0"] != rpc["decode0"]


def test_a_dense_models_ranks_are_independent_servers(stand_in: Path) -> None:  # noqa: F811
    # vLLM refuses --data-parallel-* for a dense model: its ranks start without them.
    (stand_in / "config.json").write_text('{"model_type": "llama"}')
    spec = VllmClusterSpec(model=str(stand_in), store=stand_in / "store",
                           python=sys.executable, data_parallel_size=2, num_decode=0,
                           startup_timeout_s=60)
    with VllmCluster(spec) as cluster:
        assert [(i.name, i.node) for i in cluster.instances] == [
            ("prefill0-r0", "prefill0"), ("prefill0-r1", "prefill0")]
        for inst in cluster.instances:
            assert not any(a.startswith("--data-parallel") for a in whoami(inst.url)["argv"])
