"""The paper's bottleneck-free analysis (§4.2), for any cluster.

Assumptions (the paper's): PCIe pairs each GPU with its NIC, the compute fabric has no congestion,
load is balanced, and every storage NIC reads at full rate `s*B`. Under them, PE-path traffic per
(PE, DE) GPU pair is `T_p = B*s / (D*g^2)` and DE-path traffic is `T_c = B*s / (P*g^2)`; each hop
of both paths is charged to the resource that carries it:

    PE CNIC read   PE steps 3, 5          2*T_p*D*g            = (2s/g) B
    PE CNIC write  PE step 4 + DE step 5  (T_p + T_c)*D*g      = (s/g)(1 + D/P) B
    DE CNIC read   PE 8 + DE 3, 6         (T_p + 2*T_c)*P*g    = (s/g)(P/D + 2) B
    DE CNIC write  PE 7, 9 + DE 7         (2*T_p + T_c)*P*g    = (s/g)(2P/D + 1) B
    PE DRAM        SNIC write + CNIC read 2*s*B                          <= M
    DE DRAM        PE 7, 8 + DE 2, 3, 6   (3 + 2P/D)*s*B                 <= M

so that storage reads run at full rate exactly when
`s/(g-s) <= P/D <= min{(g-2s)/s, (g-s)/(2s), (M/(Bs)-3)/2}` and `2s/g <= 1`. The paper says the
PE read direction needs only `s <= g`; it needs `s <= g/2`, which is checked here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dualpath.core.hardware import HardwareSpec
from dualpath.core.validate import positive_int


@dataclass(frozen=True)
class Constraint:
    """One resource's load when every storage NIC reads at full rate."""

    name: str
    resource: str
    load_bytes_per_s: float
    capacity_bytes_per_s: float
    bound: str
    """The condition this constraint puts on P/D (or on s), as text."""

    @property
    def utilization(self) -> float:
        return self.load_bytes_per_s / self.capacity_bytes_per_s

    @property
    def is_ok(self) -> bool:
        return self.utilization <= 1.0 + 1e-9


@dataclass(frozen=True)
class PDRange:
    """The bottleneck-free range of P/D, with every term kept so users see which one binds."""

    lower: float
    upper_de_cnic_read: float
    upper_de_cnic_write: float
    upper_de_dram: float
    pe_read_ok: bool
    """`2s/g <= 1`: the PE compute-NIC read direction, independent of P/D."""
    pe_dram_ok: bool
    """`2sB <= M`: PE-node DRAM, independent of P/D."""

    @property
    def upper(self) -> float:
        return min(self.upper_de_cnic_read, self.upper_de_cnic_write, self.upper_de_dram)

    @property
    def upper_binding(self) -> str:
        terms = {
            "de_cnic_read": self.upper_de_cnic_read,
            "de_cnic_write": self.upper_de_cnic_write,
            "de_dram": self.upper_de_dram,
        }
        return min(terms, key=lambda k: terms[k])

    @property
    def is_empty(self) -> bool:
        return not (self.pe_read_ok and self.pe_dram_ok) or self.lower > self.upper + 1e-12

    def contains(self, pd_ratio: float) -> bool:
        return not self.is_empty and self.lower - 1e-12 <= pd_ratio <= self.upper + 1e-12


def pd_range(hw: HardwareSpec) -> PDRange:
    """The paper's range for this hardware (terms that would divide by zero become inf/0)."""
    g, s = float(hw.gpus_per_node), hw.storage_nic_ratio
    b, m = hw.compute_nic_bytes_per_s, hw.dram_bytes_per_s
    lower = s / (g - s) if g > s else math.inf
    return PDRange(
        lower=lower,
        upper_de_cnic_read=(g - 2 * s) / s,
        upper_de_cnic_write=(g - s) / (2 * s),
        upper_de_dram=(m / (b * s) - 3) / 2,
        pe_read_ok=2 * s / g <= 1 + 1e-12,
        pe_dram_ok=2 * s * b <= m * (1 + 1e-12),
    )


@dataclass(frozen=True)
class Analysis:
    """The whole analysis of `P` prefill and `D` decode nodes of one hardware type."""

    hardware: str
    num_prefill_nodes: int
    num_decode_nodes: int
    gpus_per_node: int
    s: float
    compute_nic_bytes_per_s: float
    t_p_bytes_per_s: float
    t_c_bytes_per_s: float
    constraints: tuple[Constraint, ...]
    range: PDRange
    basic_read_fraction: float
    """Fraction of the prefill-side SNICs' rate a PE-only reader sustains (same accounting,
    DE-side SNICs idle)."""
    basic_utilization: float = 0.0
    """The most loaded resource's utilization when only the prefill-side SNICs read, at full
    rate (`basic_read_fraction` is its inverse, capped at 1)."""

    @property
    def pd_ratio(self) -> float:
        return self.num_prefill_nodes / self.num_decode_nodes

    @property
    def binding(self) -> Constraint:
        """The most loaded resource."""
        return max(self.constraints, key=lambda c: c.utilization)

    @property
    def is_bottleneck_free(self) -> bool:
        return all(c.is_ok for c in self.constraints)

    @property
    def storage_read_fraction(self) -> float:
        """Fraction of the aggregate storage-NIC bandwidth usable with balanced load before
        the binding resource saturates (1.0 inside the range; loads scale linearly)."""
        return min(1.0, 1.0 / self.binding.utilization)

    @property
    def storage_read_bytes_per_s(self) -> float:
        """Aggregate storage reads DualPath can sustain: both sides' SNICs, capped by the
        binding resource (per-node load scales linearly with the read rate)."""
        nodes = self.num_prefill_nodes + self.num_decode_nodes
        return nodes * self.s * self.compute_nic_bytes_per_s * self.storage_read_fraction

    def read_fractions(self, read_efficiency: float) -> tuple[float, float]:
        """(PE-only, both sides): the fraction of their effective rate the storage NICs
        sustain when they deliver `read_efficiency` of the line rate `s*B` (every load scales
        with the read rate, so a slower storage system loosens the bound)."""
        return (min(1.0, 1.0 / (self.basic_utilization * read_efficiency)),
                min(1.0, 1.0 / (self.binding.utilization * read_efficiency)))

    @property
    def basic_storage_read_bytes_per_s(self) -> float:
        """What a PE-only reader gets: the prefill nodes' SNICs alone, capped the same way."""
        return (
            self.num_prefill_nodes
            * self.s
            * self.compute_nic_bytes_per_s
            * self.basic_read_fraction
        )

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "hardware": self.hardware,
            "num_prefill_nodes": self.num_prefill_nodes,
            "num_decode_nodes": self.num_decode_nodes,
            "pd_ratio": self.pd_ratio,
            "gpus_per_node": self.gpus_per_node,
            "s": self.s,
            "compute_nic_bytes_per_s": self.compute_nic_bytes_per_s,
            "t_p_bytes_per_s": self.t_p_bytes_per_s,
            "t_c_bytes_per_s": self.t_c_bytes_per_s,
            "range": {
                **asdict(self.range),
                "upper": self.range.upper,
                "upper_binding": self.range.upper_binding,
                "is_empty": self.range.is_empty,
            },
            "inside_range": self.range.contains(self.pd_ratio),
            "is_bottleneck_free": self.is_bottleneck_free,
            "binding": self.binding.name,
            "basic_read_fraction": self.basic_read_fraction,
            "storage_read_fraction": self.storage_read_fraction,
            "storage_read_bytes_per_s": self.storage_read_bytes_per_s,
            "basic_storage_read_bytes_per_s": self.basic_storage_read_bytes_per_s,
            "constraints": [
                {**asdict(c), "utilization": c.utilization, "ok": c.is_ok} for c in self.constraints
            ],
        }


def _constraints(
    hw: HardwareSpec, p: float, d: float, pe_side_load: float, de_side_load: float
) -> tuple[float, float, tuple[Constraint, ...]]:
    """(T_p, T_c, constraints) with the PE-side SNICs reading at `pe_side_load` and the
    DE-side SNICs at `de_side_load` of their rate (1.0 = full rate)."""
    g, s = float(hw.gpus_per_node), hw.storage_nic_ratio
    b, m = hw.compute_nic_bytes_per_s, hw.dram_bytes_per_s
    t_p = pe_side_load * b * s / (d * g * g)
    t_c = de_side_load * b * s / (p * g * g)
    pe_snic, de_snic = pe_side_load * s * b, de_side_load * s * b
    constraints = (
        Constraint(
            "pe_cnic_read",
            "PE compute NIC, read (PE steps 3+5)",
            2 * t_p * d * g,
            b,
            "2s/g <= 1 (s <= g/2)",
        ),
        Constraint(
            "pe_cnic_write",
            "PE compute NIC, write (PE step 4 + DE step 5)",
            (t_p + t_c) * d * g,
            b,
            "P/D >= s/(g-s)",
        ),
        Constraint(
            "de_cnic_read",
            "DE compute NIC, read (PE step 8 + DE steps 3, 6)",
            (t_p + 2 * t_c) * p * g,
            b,
            "P/D <= (g-2s)/s",
        ),
        Constraint(
            "de_cnic_write",
            "DE compute NIC, write (PE steps 7, 9 + DE step 7)",
            (2 * t_p + t_c) * p * g,
            b,
            "P/D <= (g-s)/(2s)",
        ),
        Constraint("pe_dram", "PE node DRAM, read+write (half duplex)", 2 * pe_snic, m, "2sB <= M"),
        Constraint(
            "de_dram",
            "DE node DRAM, read+write (half duplex)",
            3 * de_snic + 2 * pe_snic * p / d,
            m,
            "P/D <= (M/(Bs)-3)/2",
        ),
    )
    return t_p, t_c, constraints


def _max_util(constraints: tuple[Constraint, ...]) -> float:
    return max(c.utilization for c in constraints)


def analyze(hw: HardwareSpec, num_prefill_nodes: int, num_decode_nodes: int) -> Analysis:
    """Charge every hop of both paths to its resource, with all storage NICs at full rate."""
    positive_int("cluster", "num_prefill_nodes", num_prefill_nodes)
    positive_int("cluster", "num_decode_nodes", num_decode_nodes)
    p, d = float(num_prefill_nodes), float(num_decode_nodes)
    t_p, t_c, constraints = _constraints(hw, p, d, 1.0, 1.0)
    _, _, basic = _constraints(hw, p, d, 1.0, 0.0)
    return Analysis(
        hardware=hw.name,
        num_prefill_nodes=num_prefill_nodes,
        num_decode_nodes=num_decode_nodes,
        gpus_per_node=hw.gpus_per_node,
        s=hw.storage_nic_ratio,
        compute_nic_bytes_per_s=hw.compute_nic_bytes_per_s,
        t_p_bytes_per_s=t_p,
        t_c_bytes_per_s=t_c,
        constraints=constraints,
        range=pd_range(hw),
        basic_read_fraction=min(1.0, 1.0 / _max_util(basic)),
        basic_utilization=_max_util(basic),
    )
