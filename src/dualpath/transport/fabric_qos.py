"""The switch and NIC side of the two traffic classes: what an operator applies so that the
fabric keeps model collectives ahead of KV transfers (paper §5.1 and appendix A.1).

InfiniBand: the subnet manager (OpenSM) maps the KV service level to virtual lane 2 and the
others to lanes 0, 1 and 3, and arbitrates with the paper's tables: lane 2 has weight 0 in the
high-priority table and 64 in the low one, the inference lanes 192 in both, and up to
`qos_high_limit` 240 (x 4 KB) of high-priority data may pass before a waiting low-priority
packet must be sent, about 99% of the link for the collectives when both are backlogged.

RoCE: NICs and switches trust DSCP; the collectives' DSCP maps to priority 3 and the KV's to
priority 2 (lossless, PFC on both, as the paper's lossless RDMA classes), each priority to its
own traffic class, and ETS gives the collectives' class 98% and the KV's 1% (whole percents
summing to 100, 1% kept for priority 0's ordinary traffic): KV still takes whatever the
collectives leave idle.

Pure text: `FabricQos.lines()`; `dualpath vllm up --print-fabric` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.core.errors import SpecError
from dualpath.transport.traffic_class import KVTrafficClass

KV_VL = 2
"""The KV lane of the paper's OpenSM tables."""
INFERENCE_VLS = (0, 1, 3)
HIGH_LIMIT = 240
VLARB_HIGH = ((0, 192), (1, 192), (2, 0), (3, 192))
VLARB_LOW = ((0, 192), (1, 192), (2, 64), (3, 192))
KV_PRIORITY = 2
COLLECTIVE_PRIORITY = 3
TC_BANDWIDTH_PERCENT = (1, 0, 1, 98, 0, 0, 0, 0)
"""ETS share of traffic classes 0-7 (class i carries priority i)."""

DEFAULT_COLLECTIVE_SL = 0
DEFAULT_COLLECTIVE_TC = 104
"""DSCP 26, the usual RoCE class of RDMA traffic."""


@dataclass(frozen=True)
class FabricQos:
    """The two classes as the fabric sees them. Frozen, validated."""

    kv_sl: int = 2
    """KV's service level (lane 2) when none is given."""
    kv_tc: int = 72
    """KV's traffic class (DSCP 18) when none is given."""
    collective_sl: int = DEFAULT_COLLECTIVE_SL
    """NCCL_IB_SL of the model's collectives."""
    collective_tc: int = DEFAULT_COLLECTIVE_TC
    """NCCL_IB_TC of the model's collectives."""
    interface: str = "<rdma-netdev>"
    """The RoCE NIC's network device in the printed mlnx_qos lines."""

    def __post_init__(self) -> None:
        KVTrafficClass(ib_sl=self.kv_sl, traffic_class=self.kv_tc)
        KVTrafficClass(ib_sl=self.collective_sl, traffic_class=self.collective_tc)
        if self.kv_sl == self.collective_sl:
            raise SpecError("fabric", "kv_sl", self.kv_sl,
                            f"must differ from the collectives' NCCL_IB_SL {self.collective_sl}")
        if self.kv_tc >> 2 == self.collective_tc >> 2:
            raise SpecError("fabric", "kv_tc", self.kv_tc,
                            f"its DSCP {self.kv_tc >> 2} must differ from the collectives' "
                            f"(NCCL_IB_TC {self.collective_tc})")

    @property
    def kv(self) -> KVTrafficClass:
        return KVTrafficClass(ib_sl=self.kv_sl, traffic_class=self.kv_tc)

    def sl2vl(self) -> list[int]:
        """Lane of each of the 16 service levels: KV's to lane 2, the others to an inference
        lane (their own number where that is one, else lane 0)."""
        return [KV_VL if sl == self.kv_sl else (sl if sl in INFERENCE_VLS else 0)
                for sl in range(16)]

    def opensm_lines(self) -> list[str]:
        def table(weights: tuple[tuple[int, int], ...]) -> str:
            return ",".join(f"{vl}:{w}" for vl, w in weights)

        return ["qos TRUE",
                "qos_max_vls 4",
                f"qos_high_limit {HIGH_LIMIT}",
                f"qos_vlarb_high {table(VLARB_HIGH)}",
                f"qos_vlarb_low {table(VLARB_LOW)}",
                f"qos_sl2vl {','.join(map(str, self.sl2vl()))}"]

    def roce_lines(self) -> list[str]:
        nic = f"mlnx_qos -i {self.interface}"
        pfc = ",".join("1" if p in (KV_PRIORITY, COLLECTIVE_PRIORITY) else "0" for p in range(8))
        return [f"{nic} --trust dscp",
                f"{nic} --dscp2prio set,{self.collective_tc >> 2},{COLLECTIVE_PRIORITY}",
                f"{nic} --dscp2prio set,{self.kv_tc >> 2},{KV_PRIORITY}",
                f"{nic} --pfc {pfc}",
                f"{nic} --prio_tc {','.join(str(p) for p in range(8))}",
                f"{nic} --tsa {','.join(['ets'] * 8)} "
                f"--tcbw {','.join(map(str, TC_BANDWIDTH_PERCENT))}"]

    def lines(self) -> list[str]:
        """The whole printout: the hosts' settings, OpenSM's, the RoCE NICs' and switches'."""
        kv_dscp, coll_dscp = self.kv_tc >> 2, self.collective_tc >> 2
        share = TC_BANDWIDTH_PERCENT
        return [
            "# DualPath traffic classes: model collectives high, KV transfers low "
            "(paper 5.1, A.1)",
            f"# KV (the connector's NIXL/UCX agents): IB SL {self.kv_sl} -> VL {KV_VL}, "
            f"RoCE traffic class {self.kv_tc} (DSCP {kv_dscp}) -> priority {KV_PRIORITY}",
            f"#   dualpath vllm up --kv-sl {self.kv_sl} --kv-tc {self.kv_tc}   "
            f"(kv_connector_extra_config: kv_ib_sl {self.kv_sl}, kv_traffic_class "
            f"{self.kv_tc})",
            f"# Collectives (NCCL), on every vLLM host: SL {self.collective_sl} -> VL "
            f"{self.sl2vl()[self.collective_sl]}, DSCP {coll_dscp} -> priority "
            f"{COLLECTIVE_PRIORITY}",
            f"export NCCL_IB_SL={self.collective_sl}",
            f"export NCCL_IB_TC={self.collective_tc}",
            "",
            "# InfiniBand: opensm.conf of the subnet manager (then restart OpenSM). The high",
            f"# table carries VLs {', '.join(map(str, INFERENCE_VLS))}; VL {KV_VL} (KV) is "
            f"served from the low table, after at most {HIGH_LIMIT} x 4 KB of high-priority "
            "data (~99% of a busy link to the collectives).",
            *self.opensm_lines(),
            "",
            "# RoCE: every host's RDMA NIC (NVIDIA mlnx_qos). Lossless (PFC) priorities "
            f"{KV_PRIORITY} and {COLLECTIVE_PRIORITY}; ETS {share[COLLECTIVE_PRIORITY]}% "
            f"collectives, {share[KV_PRIORITY]}% KV, {share[0]}% priority 0.",
            *self.roce_lines(),
            "# RoCE switches: trust DSCP with the same map (DSCP "
            f"{coll_dscp} -> priority {COLLECTIVE_PRIORITY}, DSCP {kv_dscp} -> priority "
            f"{KV_PRIORITY}), PFC on priorities {KV_PRIORITY} and {COLLECTIVE_PRIORITY}, the "
            "same ETS weights.",
        ]
