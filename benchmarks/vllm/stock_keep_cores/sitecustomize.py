"""For `vllm_pd_bench.py --stock-keep-cores` only (an emulation correction, not stock vLLM):
loaded by every process of a stock vLLM instance through PYTHONPATH, it confines
`os.sched_setaffinity` to the instance's own cores (`VLLM_CPU_OMP_THREADS_BIND`).
NixlConnector's CPU worker pins its thread, the one that runs the model, to the last core of
each NUMA node, which assumes one instance per host; with several instances emulating hosts
on one machine, every instance's model would run on that one core."""

import os

_bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
if _bind and all(p.isdigit() for p in _bind.split(",")):
    _cores = {int(p) for p in _bind.split(",")}
    _set_affinity = os.sched_setaffinity

    def _within_own_cores(pid: int, mask: object) -> None:
        _set_affinity(pid, (set(mask) & _cores) or _cores)  # type: ignore[call-overload]

    os.sched_setaffinity = _within_own_cores
