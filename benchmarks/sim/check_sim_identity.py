"""Simulator identity check: record, then compare, every run's per-request CSV, a full-precision
hash of its records and its summary JSON over a fixed set of small configurations.

    python benchmarks/sim/check_sim_identity.py record /tmp/simref   # before a change
    python benchmarks/sim/check_sim_identity.py check /tmp/simref    # after: exit 1 on any diff

A performance change to `dualpath.sim` or `dualpath.sched` must leave every output identical.
`--large` adds two runs the fixed set does not reach (about 40 s compiled): 48P96D, where
prefill steps fan out to many decode nodes (the flow solver's wide flows and its component
cap), and a saturated 6P12D at 1,000 agents per prefill node (storage-bound, as the paper's
largest run), where most flow starts and ends re-rate others.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dualpath.core.cluster import ClusterSpec
from dualpath.core.hardware import hardware_preset
from dualpath.core.model import model_preset
from dualpath.sim import Driver, SimConfig, SimResult, Workload, simulate
from dualpath.sim.workload import agent_workload
from dualpath.workload.mooncake import load_mooncake

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "mooncake_excerpt.jsonl"


def _configs(large: bool = False) -> Iterator[tuple[str, SimConfig]]:
    hw = hardware_preset("h800-deepseek")
    v32 = ClusterSpec(hw, model_preset("deepseek-v3.2"), 2, 4)
    for agents in (64, 256):
        wl = agent_workload("64k", agents)
        for mode in ("basic", "dualpath", "oracle", "split", "dual-path"):
            yield (f"v32_2p4d_{agents}_{mode}",
                   SimConfig(v32, wl, driver=Driver(num_agents=agents)).with_mode(mode))
    ds27 = ClusterSpec(hw, model_preset("ds-27b"), 1, 1)
    wl = agent_workload("32k", 64)
    for mode in ("dualpath", "basic"):
        yield (f"ds27b_1p1d_online_{mode}",
               SimConfig(ds27, wl, driver=Driver(kind="online", num_agents=48, agents_per_s=0.5,
                                                 max_duration_s=900.0)).with_mode(mode))
    trace = Workload.from_mooncake(load_mooncake(FIXTURE))
    for mode in ("dualpath", "basic", "split"):
        yield (f"mooncake_ds27b_1p1d_{mode}",
               SimConfig(ds27, trace, driver=Driver(kind="replay")).with_mode(mode))
    v32_big = ClusterSpec(hw, model_preset("deepseek-v3.2"), 4, 8)
    wl = agent_workload("48k", 256, max_len_tokens=32768)
    yield ("v32_4p8d_256_dualpath_32k",
           SimConfig(v32_big, wl, driver=Driver(num_agents=256)).with_mode("dualpath"))
    if not large:
        return
    for p, d, agents in ((48, 96, 3000), (6, 12, 6000)):
        spec = ClusterSpec(hw, model_preset("deepseek-v3.2"), p, d)
        yield (f"large_v32_{p}p{d}d_{agents}_dualpath",
               SimConfig(spec, agent_workload("64k", agents),
                         driver=Driver(num_agents=agents)).with_mode("dualpath"))


def _outputs(result: SimResult) -> tuple[str, str, str]:
    buf = io.StringIO()
    result.write_csv(buf)
    h = hashlib.sha256()
    for k in sorted(result.records):
        h.update(k.encode())
        h.update(np.ascontiguousarray(np.asarray(result.records[k])).tobytes())
    summary = json.dumps(result.summary(), sort_keys=True, indent=1, default=repr)
    return buf.getvalue(), h.hexdigest(), summary


def _read(path: Path) -> str:
    # newline="": the CSV's \r\n line ends must compare as written.
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("record", "check"))
    ap.add_argument("dir", type=Path)
    ap.add_argument("--only", default="", help="run only configs whose name contains this")
    ap.add_argument("--large", action="store_true",
                    help="also 48P96D (wide flows) and a saturated 6P12D (about 40 s compiled)")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    bad = 0
    total = time.perf_counter()
    for name, cfg in _configs(args.large):
        if args.only not in name:
            continue
        t = time.perf_counter()
        csv_text, digest, summary = _outputs(simulate(cfg))
        wall = time.perf_counter() - t
        files = {f"{name}.csv": csv_text, f"{name}.sha256": digest, f"{name}.json": summary}
        if args.action == "record":
            for fn, text in files.items():
                (args.dir / fn).write_text(text, encoding="utf-8", newline="")
            print(f"recorded {name} ({wall:.2f} s)")
            continue
        diffs = [fn for fn, text in files.items() if _read(args.dir / fn) != text]
        bad += bool(diffs)
        print(f"{'DIFF ' + ','.join(diffs) if diffs else 'same'}  {name} ({wall:.2f} s)")
    print(f"total {time.perf_counter() - total:.1f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
