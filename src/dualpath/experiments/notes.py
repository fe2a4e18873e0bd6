"""Why the simulator's numbers differ from the paper's: causes we can name, without numbers
(the numbers are in the generated tables). Kept in one place so the report states them once."""

from __future__ import annotations

DIFFERENCES = """## Where we differ from the paper, and why

These causes apply to every section; each section's tables show how large the differences are.

1. **Traces.** The paper's production traces are not public; we replay Table-2-matched synthetic
   trajectories (`dualpath.workload.synthetic`, being refined in parallel by the workload
   engineer, so numbers move with its commits). Offline JCT is the *last* agent's finish time,
   so it depends on the longest trajectories, which Table 2's averages do not pin down.
2. **Decode cost of MoE models (a bug we found, reported to the coordinator).** The cost model
   (`dualpath.sched.cost.decode_weight_read_bytes`) charges each decode step the MoE weights
   divided over the GPUs of *one node* (84 GB per step for DeepSeek-V3.2), while the simulator
   places those weights over *all* decode GPUs (4 nodes at 2P4D, 21 GB each). DS 660B decode
   steps therefore cost about 45 ms even at small batches, and DS 660B Oracle runs are bound by
   per-agent decode latency: their JCT hardly grows from 512 to 1,024 agents, where the paper's
   grows about 1.4x. This is not tuned away in the calibration.
3. **One GPU-time factor per model.** Calibration scales all GPU times of a model by one factor
   fitted to three Oracle cells; the relative cost of prefill, decode and fixed overheads comes
   from the roofline-style cost model, not from measurements of the paper's kernels.
4. **Storage and network are idealized.** Storage NICs are the only storage limit (3FS without a
   DRAM cache saturates them, as the paper states); flows share links max-min fairly; the
   compute-NIC QoS is a 99:1 two-class split; there is no RDMA or PCIe contention model beyond
   link capacities.
5. **The SLO judgement, and quick online runs are not steady.** The paper stops an online run
   when TTFT exceeds 4 s or at steady state after 30 minutes; we judge means over the last two
   thirds of fixed-length runs (600 s quick, 2,400 s full) and abort a run when any turn waits
   more than 20 s. A 64K trajectory lives for hundreds to thousands of seconds (157 turns on
   average), so in a 600 s run the agents are still in their early, short-context turns: load
   and KV reads are far below steady state, and quick-scale capacities are overstated (by up to
   an order of magnitude against the paper's 0.4 APS for DS 660B 2P4D). Quick online numbers
   show the machinery, not the paper's capacities; only full-length runs can test Figs. 10-11.
6. **Scale.** Table 3's 1,152-GPU runs (4 million turns) are out of reach of this 2-core machine;
   we scale the cluster by 2x (quick) or 4x (full) instead.
"""
