"""The kill test on a 1P1D cluster of its own (real vLLM servers, SmolLM2): the decode, then
the prefill vLLM server SIGKILLed under load behind `dualpath route` and restarted by
`VllmCluster.supervise`, as `dualpath vllm up` does (`pd_kit/failover.py` says what is checked).

Run in the vLLM venv (`make vllm-setup`): `.venv-vllm/bin/python examples/vllm_pd_failover.py`.
Prints JSON; non-zero exit on a failed check.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from dualpath.integrations.vllm.cluster.launch import VllmCluster
from dualpath.integrations.vllm.cluster.spec import HOST_MODES, HOSTS_HELP, VllmClusterSpec
from pd_kit.failover import NUM_PROMPTS, checks, failover_phase, shm_left
from pd_kit.prompts import chat_prompt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--model", help="an HF-style Llama folder (default: converted SmolLM2)")
    ap.add_argument("--hosts", choices=HOST_MODES, default="loopback", help=HOSTS_HELP)
    args = ap.parse_args()
    if args.model is None:
        from dualpath.runtime.model.weights import smollm2_folder

        args.model = str(smollm2_folder())
    with tempfile.TemporaryDirectory(prefix="dualpath-vllm-failover-") as tmp:
        spec = VllmClusterSpec(model=args.model, store=Path(tmp) / "store",
                               python=sys.executable, hosts=args.hosts, kv_events=True,
                               extra_args=("--served-model-name", "smollm2"))
        t = time.perf_counter()
        with VllmCluster(spec) as cluster:
            startup_s = round(time.perf_counter() - t, 1)
            tag = cluster.instances[0].tag.split(".")[0] + "."
            base = chat_prompt(args.model)
            prompts = [[*base, 100 + k] for k in range(NUM_PROMPTS)]
            result = failover_phase(cluster, spec.store, "smollm2", prompts)
    result["startup_s"] = startup_s
    result["total_s"] = round(time.perf_counter() - t, 1)
    result["shm_left"] = shm_left(tag)
    result["checks"] = {**checks(result),
                        "failover: no shared memory of the cluster left": not result["shm_left"]}
    print(json.dumps(result, indent=1))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
