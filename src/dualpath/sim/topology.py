"""The simulated cluster as a `SimConfig` describes it: nodes, engines, the links that carry
their traffic, the engine groups that step together, and the cost model's constants.

Links per node: storage NIC read (at the storage system's calibrated read rate) and write (at
the line rate), DRAM (half duplex: reads and writes share it); per engine: compute NIC read and
write (each capped by PCIe); optionally one storage-cluster cap shared by every read. Engine ids
follow `core.cluster`: node `n` holds engines `n*g .. n*g+g-1`, prefill nodes first.

Built once per run; afterwards only the mutable parts of `Node`, `Engine` and the groups change
(`handlers.py`), and link capacities (the compute NICs' KV share).
"""

from __future__ import annotations

from dataclasses import replace

from dualpath.core.errors import SpecError
from dualpath.core.read_rate import storage_read_model
from dualpath.sched import cost as costmod
from dualpath.sched.params import SchedulerParams
from dualpath.sched.types import WaitingRequest
from dualpath.sim.config import SimConfig
from dualpath.sim.flows import Link
from dualpath.sim.state import DecodeGroup, Engine, Node, PrefillGroup
from dualpath.sim.workload import Workload


class Cluster:
    """The topology and its constants; the run's mutable state lives in its nodes, engines
    and groups."""

    def __init__(self, config: SimConfig) -> None:
        cl = config.cluster
        sp = config.params
        self.model, self.hw = cl.model, cl.engine_hardware
        """`hw`: the node as its engines see it (one GPU each, or a tensor-parallel group)."""
        coeffs = costmod.coefficients_for(self.model, self.hw)
        if config.cost_overrides:
            coeffs = replace(coeffs, **dict(config.cost_overrides))  # type: ignore[arg-type]
        self.coeffs = coeffs
        self.hbm_reserve = (coeffs.hbm_reserve_fraction if sp.hbm_reserve_fraction is None
                            else sp.hbm_reserve_fraction)
        self.step_costs = config.step_costs
        """Measured step costs charged instead of the roofline model (None: the roofline)."""
        self.attn_fixed_s = (costmod.attention_fixed_time_s(self.model, coeffs)
                             if self.step_costs is None else self.step_costs.prefill_fixed_s)
        """Attention time of an engine with nothing to prefill (it still joins a step)."""
        self.kv_bpt = self.model.kv_bytes_per_token
        self.block = sp.block_size_tokens
        self.is_sync = (
            self.model.is_moe if sp.is_group_synchronized is None else sp.is_group_synchronized
        )
        """Engines of a node step together (expert parallel): one group per node."""
        self.links: list[Link] = []
        bin_s = sp.utilization_bin_s
        # KV reads run at the storage system's calibrated rate; writes at the line rate.
        storage = sp.storage_read or storage_read_model(self.hw.name)
        full_block = self.kv_bpt * self.block
        snic_read_bytes_per_s = storage.read_bytes_per_s(
            self.hw.storage_nic_bytes_per_s, full_block)
        self.read_stream_cap_bytes_per_s = (
            sp.read_streams_per_request * full_block / storage.read_time_s(full_block)
            if sp.read_streams_per_request else 0.0)
        """The most one request's read moves (`SimParams.read_streams_per_request`); 0: none."""
        cnic = min(self.hw.compute_nic_bytes_per_s, self.hw.pcie_bytes_per_s)
        self.cnic_bytes_per_s = cnic
        self.storage_link = (
            self._link("storage", "storage", -1, sp.storage_cluster_bytes_per_s, bin_s)
            if sp.storage_cluster_bytes_per_s > 0 else None
        )

        # MoE weights are sharded over every engine of a role (EP across that role's nodes,
        # as DeepSeek-V3.2 needs: 671 GB of FP8 weights do not fit one node's 8 x 80 GB);
        # dense weights are replicated per engine.
        def kv_room(num_engines: int) -> float:
            return costmod.kv_room_bytes(self.model, self.hw, self.hbm_reserve, num_engines)

        def ep_group(size: int, side: int) -> int:  # 0, or more than the side: the whole side
            return min(size or side, side)

        self.pe_hbm_kv_bytes = kv_room(ep_group(sp.prefill_ep_engines, cl.num_prefill_engines))
        """HBM a prefill engine has for KV (its weight share and the reserve taken)."""
        # Decode steps read each engine's shard of those same weights.
        self.decode_ep_engines = ep_group(sp.decode_ep_engines, cl.num_decode_engines)
        self.de_hbm_kv_bytes = kv_room(self.decode_ep_engines)
        self.nodes: list[Node] = []
        self.engines: list[Engine] = []
        self._build_nodes(config, snic_read_bytes_per_s, bin_s)
        pe_nodes = range(cl.num_prefill_nodes)
        self.de_nodes = range(cl.num_prefill_nodes, cl.num_nodes)
        if self.is_sync:
            self.pgroups = [PrefillGroup(i, self.nodes[n].engines) for i, n in enumerate(pe_nodes)]
            self.dgroups = [DecodeGroup(self.nodes[n].engines) for n in self.de_nodes]
        else:
            pe_engines = [e for n in pe_nodes for e in self.nodes[n].engines]
            de_engines = [e for n in self.de_nodes for e in self.nodes[n].engines]
            self.pgroups = [PrefillGroup(i, [e]) for i, e in enumerate(pe_engines)]
            self.dgroups = [DecodeGroup([e]) for e in de_engines]
        self.pgroup_of = {e: grp for grp in self.pgroups for e in grp.engines}
        self.dgroup_of = {e: grp for grp in self.dgroups for e in grp.engines}
        self.dgroup_index = {e: gi for gi, grp in enumerate(self.dgroups) for e in grp.engines}

    def _build_nodes(self, config: SimConfig, snic_read_bytes_per_s: float, bin_s: float) -> None:
        cl, hw, sp = config.cluster, self.hw, config.params
        g = hw.gpus_per_node
        cnic = self.cnic_bytes_per_s
        for n in range(cl.num_nodes):
            is_pf = n < cl.num_prefill_nodes
            node = Node(
                n, is_pf, list(range(n * g, n * g + g)),
                self._link(f"n{n}.snic_read", "snic_read", n, snic_read_bytes_per_s, bin_s),
                self._link(f"n{n}.snic_write", "snic_write", n, hw.storage_nic_bytes_per_s,
                           bin_s),
                self._link(f"n{n}.dram", "pe_dram" if is_pf else "de_dram", n,
                           hw.dram_bytes_per_s, bin_s),
                float(hw.dram_buffer_bytes),
                (sp.pe_reads if is_pf else sp.de_reads).num_slots,
            )
            self.nodes.append(node)
            side = "pe" if is_pf else "de"
            for e in node.engines:
                self.engines.append(Engine(
                    e, n,
                    self._link(f"e{e}.cnic_read", f"{side}_cnic_read", n, cnic, bin_s),
                    self._link(f"e{e}.cnic_write", f"{side}_cnic_write", n, cnic, bin_s),
                    self.pe_hbm_kv_bytes if is_pf else self.de_hbm_kv_bytes,
                ))

    def _link(self, name: str, kind: str, node: int, cap: float, bin_s: float) -> Link:
        link = Link(name, kind, node, cap, bin_s)
        self.links.append(link)
        return link

    def check_requests_fit(self, workload: Workload, params: SchedulerParams) -> None:
        """Refuse a workload whose largest turn can never be placed on a decode engine (its
        HBM reservation exceeds what an empty engine has for KV): it would wait forever."""
        prompt, gen = workload.prompt_tokens.tolist(), workload.gen_tokens.tolist()
        if not prompt:
            return
        row = max(range(len(prompt)), key=lambda i: prompt[i] + gen[i])
        hit = workload.hit_tokens.tolist()
        need = params.hbm_bytes(WaitingRequest(0, prompt[row], hit[row], gen[row]))
        if need > self.de_hbm_kv_bytes:
            raise SpecError(
                "sim", "workload", f"turn of {prompt[row]}+{gen[row]} tokens",
                f"needs {need / 1e9:.1f} GB of decode-engine HBM for KV but an engine has "
                f"{self.de_hbm_kv_bytes / 1e9:.1f} GB (HBM x {1 - self.hbm_reserve:g} "
                f"minus its weight share); {self._fit_hint()}",
            )

    def _fit_hint(self) -> str:
        """What would give a decode engine more room for KV, for this model."""
        tp = self.hw.gpus_per_engine
        more = ("larger engines (--tensor-parallel-size"
                + (f", now {tp}" if tp > 1 else "") + ")")
        if self.model.is_moe:
            more = f"a larger expert-parallel group (--decode-ep-engines) or {more}"
        return f"use a shorter --mal, more HBM, smaller KV/weights or {more}"
