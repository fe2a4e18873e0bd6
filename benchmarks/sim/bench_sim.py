"""Simulator speed: simulated turns per wall-clock second and per CPU-second of this process.

Runs DeepSeek-V3.2 on 2P4D (h800-deepseek), Table-2 64K trajectories, offline, in `dualpath`
mode and, as the in-process baseline, in `oracle` mode (no I/O flows: what the event loop,
scheduler calls and decode epochs cost alone). Reports medians over repeats.

    python benchmarks/sim/bench_sim.py [--agents 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import dualpath
from dualpath.core.cluster import ClusterSpec
from dualpath.core.hardware import hardware_preset
from dualpath.core.model import model_preset
from dualpath.sim import Driver, SimConfig, simulate
from dualpath.sim.workload import agent_workload


def _turns_per_s(cfg: SimConfig) -> tuple[float, float, float]:
    """(turns per wall second, wall seconds, turns per CPU second of this process); the CPU
    rate is what to compare on a machine shared with other jobs."""
    started, cpu = time.perf_counter(), time.process_time()
    result = simulate(cfg)
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu
    return result.num_completed / wall, wall, result.num_completed / max(cpu, 1e-9)


def _cpu_model() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill-nodes", type=int, default=2)
    ap.add_argument("--decode-nodes", type=int, default=4)
    args = ap.parse_args()
    cluster = ClusterSpec(hardware_preset("h800-deepseek"), model_preset("deepseek-v3.2"),
                          args.prefill_nodes, args.decode_nodes)
    workload = agent_workload("64k", args.agents)
    base = SimConfig(cluster, workload, driver=Driver(num_agents=args.agents))
    print(f"{cluster.label}, deepseek-v3.2, 64K, {args.agents} agents, "
          f"{workload.num_turns} turns, {args.repeats} repeats, "
          f"simulator: {dualpath.IMPLEMENTATION}")
    # A figure is only comparable with its machine and the load on it: print both with the date.
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"  {time.strftime('%Y-%m-%d %H:%M %Z')}, {_cpu_model()}, {os.cpu_count()} CPUs, "
          f"load average {load}")
    rates: dict[str, list[float]] = {}
    walls: dict[str, list[float]] = {}
    cpu_rates: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for mode in ("oracle", "dualpath"):
            rate, wall, cpu_rate = _turns_per_s(base.with_mode(mode))
            rates.setdefault(mode, []).append(rate)
            walls.setdefault(mode, []).append(wall)
            cpu_rates.setdefault(mode, []).append(cpu_rate)
    for mode in ("oracle", "dualpath"):
        print(f"  {mode:<9} median {statistics.median(rates[mode]):>9,.0f} turns/s wall, "
              f"{statistics.median(cpu_rates[mode]):>9,.0f} turns/CPU-s "
              f"(wall median {statistics.median(walls[mode]):.2f} s)")
    ratio = statistics.median(rates["dualpath"]) / statistics.median(rates["oracle"])
    print(f"  dualpath / oracle speed ratio: {ratio:.2f} (the cost of simulating I/O flows)")
    print("  goal: >= 20,000 turns/CPU-s in dualpath mode (compiled)")
    if dualpath.IMPLEMENTATION != "compiled":
        print(f"  NOTE: pure Python ({dualpath.IMPLEMENTATION}): about 3x slower than compiled; "
              "run `make compile` for the figure the goal is about")


if __name__ == "__main__":
    main()
