"""The mode switches both worlds run under (ARCHITECTURE.md "Modes"): composable switches, not
forks of the code. The simulator (`dualpath.sim.SimConfig.mode`) and the runtime
(`dualpath.runtime.run_config.RunConfig.mode`, by preset name) read the same `Mode`, so every
ablation step of the paper runs in both."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.core.errors import SpecError, UnknownPresetError

PATHS = ("pe", "dual", "split")
SCHEDULERS = ("round_robin", "dualpath")
IO_MODES = ("real", "oracle")


@dataclass(frozen=True)
class Mode:
    """Composable switches (ARCHITECTURE.md "Modes"), not forks of the code."""

    is_layerwise: bool = True
    """Layerwise prefill: per-layer KV streaming overlapped with compute, no HBM limit on hits."""
    paths: str = "dual"
    """`pe`: read hits on the PE side only; `dual`: the side with the shorter read queue;
    `split`: split one request's read across both sides (the paper's future work)."""
    scheduler: str = "dualpath"
    """`round_robin`: engines in turn (the simulator also drops the compute quota for a token
    cap); `dualpath`: Algorithm 1, two-level DE scheduling and the intra-engine compute quota."""
    io: str = "real"
    """`oracle`: every storage read, H2D/D2H copy and PD KV transfer is bypassed (simulator) or
    unpaced (runtime: the bytes still move, so outputs stay the same)."""

    def __post_init__(self) -> None:
        for name, value, valid in (
            ("paths", self.paths, PATHS),
            ("scheduler", self.scheduler, SCHEDULERS),
            ("io", self.io, IO_MODES),
        ):
            if value not in valid:
                raise SpecError("mode", name, value, f"must be one of {', '.join(valid)}")

    @property
    def is_oracle(self) -> bool:
        return self.io == "oracle"

    @property
    def is_round_robin(self) -> bool:
        return self.scheduler == "round_robin"


MODE_PRESETS: dict[str, Mode] = {
    "basic": Mode(is_layerwise=False, paths="pe", scheduler="round_robin"),
    "layerwise": Mode(is_layerwise=True, paths="pe", scheduler="round_robin"),
    "dual-path": Mode(is_layerwise=True, paths="dual", scheduler="round_robin"),
    "dualpath": Mode(),
    "split": Mode(paths="split"),
    "oracle": Mode(io="oracle"),
}
"""The paper's baselines and ablation steps: basic, +layerwise, +dual-path, dualpath (all),
oracle (I/O bypassed) and the split-read extension."""


def mode_preset(name: str) -> Mode:
    """The named mode; UnknownPresetError lists the valid names."""
    try:
        return MODE_PRESETS[name]
    except KeyError:
        raise UnknownPresetError("mode", name, list(MODE_PRESETS)) from None
