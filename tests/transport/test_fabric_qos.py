"""The fabric side of the traffic classes: OpenSM's lane map and the paper's arbitration
tables, the RoCE NICs' DSCP map and ETS weights, and classes that would collide refused."""

from __future__ import annotations

import pytest

from dualpath.core.errors import SpecError
from dualpath.transport.fabric_qos import FabricQos


def test_opensm_puts_kv_alone_on_the_low_lane_with_the_papers_weights() -> None:
    fabric = FabricQos(kv_sl=5, kv_tc=72, collective_sl=1)
    sl2vl = fabric.sl2vl()
    assert len(sl2vl) == 16
    assert [sl for sl, vl in enumerate(sl2vl) if vl == 2] == [5]
    assert sl2vl[1] == 1 and sl2vl[0] == 0 and sl2vl[3] == 3
    lines = fabric.opensm_lines()
    assert "qos_high_limit 240" in lines
    assert "qos_vlarb_high 0:192,1:192,2:0,3:192" in lines
    assert "qos_vlarb_low 0:192,1:192,2:64,3:192" in lines
    assert f"qos_sl2vl {','.join(map(str, sl2vl))}" in lines


def test_roce_maps_each_dscp_to_its_priority_and_weights_sum_to_100() -> None:
    fabric = FabricQos(kv_tc=40, collective_tc=106, interface="eth9")
    lines = fabric.roce_lines()
    assert "mlnx_qos -i eth9 --dscp2prio set,26,3" in lines  # 106 >> 2
    assert "mlnx_qos -i eth9 --dscp2prio set,10,2" in lines  # 40 >> 2
    assert "mlnx_qos -i eth9 --pfc 0,0,1,1,0,0,0,0" in lines
    tcbw = next(x for x in lines if "--tcbw" in x).split("--tcbw ")[1].split(",")
    assert sum(map(int, tcbw)) == 100 and int(tcbw[3]) > 90 * int(tcbw[2])
    everything = "\n".join(fabric.lines())
    assert "export NCCL_IB_TC=106" in everything and "--kv-tc 40" in everything


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"kv_sl": 0, "collective_sl": 0}, "kv_sl"),
    ({"kv_tc": 105, "collective_tc": 104}, "kv_tc"),  # the same DSCP 26
    ({"kv_sl": 16}, "ib_sl"),
])
def test_colliding_or_bad_classes_are_refused(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(SpecError, match=field):
        FabricQos(**kwargs)
