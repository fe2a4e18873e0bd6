"""The Fig. 12 (right) ablation, offline: JCT of Basic, +layerwise, +dual-path and DualPath; and
from the same runs Figs. 13-14, the storage-NIC traffic and attention-time Max/Avg of the round
robin (`dual-path`) against DualPath's scheduling."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from dualpath.plan.runner import RunSpec
from dualpath.plan.section import Claim, Context, Section, md_table, within, write_csv
from dualpath.plan.setups import setup
from dualpath.reproduce import plots
from dualpath.reproduce.offline import pick
from dualpath.reproduce.paper import CLAIMS
from dualpath.sim.result import FIRST_FRACTION, SimResult, mean_finite, window_max_over_avg

ABLATION = ("basic", "layerwise", "dual-path", "dualpath")

PAPER_ABLATION_REDUCTION = {"layerwise": 17.21, "dual-path": 38.19, "dualpath": 45.62}


def ablation(ctx: Context) -> Section:
    """Fig. 12 right: basic -> +layerwise -> +dual-path -> +scheduling, and Figs. 13-14: the
    storage-NIC and attention-time Max/Avg of round robin (`dual-path`) vs DualPath."""
    started = time.perf_counter()
    name = "ds660b_2p4d"
    agents = [int(str(a)) for a in pick(ctx.agents, (512,) if ctx.is_quick else (1024, 2048))]
    rows: list[list[object]] = []
    red: dict[str, list[float]] = {m: [] for m in ABLATION}
    bal: dict[str, list[SimResult]] = {"dual-path": [], "dualpath": []}
    ctx.runner.prefetch(RunSpec(name, m, n, "64k") for n in agents for m in ABLATION)
    for n in agents:
        res = {m: ctx.runner.run(RunSpec(name, m, n, "64k")) for m in ABLATION}
        for m in ABLATION:
            r = res[m]
            reduction = 100.0 * (1.0 - r.jct_s / res["basic"].jct_s)
            red[m].append(reduction)
            rows.append([n, m, r.jct_s, reduction, r.snic_window_max_over_avg,
                         r.attention_ran_max_over_avg, r.attention_ran_max_over_avg_first5,
                         r.attention_engines_ran_mean])
            if m in bal:
                bal[m].append(r)
    csvp = write_csv(ctx.path("fig12_ablation.csv"),
                     ["agents", "mode", "sim_jct_s", "reduction_pct",
                      "snic_window_max_over_avg", "attn_ran_max_over_avg",
                      "attn_ran_max_over_avg_first5pct", "attn_engines_ran_per_step"], rows)
    mean_red = {m: sum(v) / len(v) for m, v in red.items()}
    png = plots.grouped_bars(
        ctx.path("fig12_ablation.png"), ["JCT reduction vs Basic"],
        {m: [mean_red[m]] for m in ABLATION[1:]}, "JCT reduction vs Basic (%)",
        f"Fig. 12 ablation, {setup(name).label}, 64K, agents {agents}",
        paper={m: [PAPER_ABLATION_REDUCTION[m]] for m in ABLATION[1:]},
    )
    tab = [[m, f"{mean_red[m]:.1f}%", f"{PAPER_ABLATION_REDUCTION.get(m, 0.0):.2f}%"]
           for m in ABLATION[1:]]
    body = (f"**Paper:** {CLAIMS['fig12']}\n\n{setup(name).label}, 64K MAL, agents "
            f"{', '.join(map(str, agents))} (mean over them). Steps: `layerwise` = +layerwise "
            "prefill; `dual-path` = +dual-path loading (round-robin scheduling); `dualpath` = "
            "+DualPath scheduling.\n\n"
            + md_table(["step", "simulated JCT reduction", "paper"], tab))
    balance_body, balance_files, balance_claims = _balance(ctx, name, agents, bal)
    body += balance_body
    causes = {"layerwise": "the HBM limit of a non-layerwise prefill engine never leaves our "
                           "storage NICs idle (notes item 4)"}
    claims = [Claim(f"Fig. 12 ablation (DS 660B 64K, agents {agents}): {m} JCT vs Basic",
                    f"-{PAPER_ABLATION_REDUCTION[m]:.1f}%", f"-{mean_red[m]:.1f}%",
                    abs(mean_red[m] - PAPER_ABLATION_REDUCTION[m]) <= 5.0, "within 5 points",
                    causes.get(m, ""))
              for m in ABLATION[1:]]
    return Section("fig12", "Fig. 12 (right) ablation and Figs. 13-14 load balance", body,
                   (csvp, png, *balance_files), time.perf_counter() - started, ctx.scale,
                   (*claims, *balance_claims))


BALANCE_MODES = {"dual-path": "round_robin", "dualpath": "dualpath"}
"""The two runs Figs. 13-14 compare (both layerwise with dual-path reads), by plot label."""


def _balance(ctx: Context, name: str, agents: Sequence[int],
             bal: dict[str, list[SimResult]]) -> tuple[str, tuple[Path, ...], tuple[Claim, ...]]:
    """Figs. 13-14 from the ablation's round-robin and DualPath runs: the storage-NIC traffic
    Max/Avg across machines per time window, and the attention-time Max/Avg across the engines
    of an EP group that ran in a step, over the first 5% of the run and over all of it."""
    def avg(mode: str, metric: str) -> float:
        return _mean([float(getattr(r, metric)) for r in bal[mode]])

    def snic(mode: str, how: str) -> float:
        """Storage-NIC window Max/Avg of `mode` (mean over the runs): `mean` over windows,
        `weighted` by the bytes read in each window, `triples` as `mean` but over every three
        machines (the mean over the triples)."""
        out = []
        for r in bal[mode]:
            b = _snic_window_bytes(r)
            if how == "mean":
                out.append(r.snic_window_max_over_avg)
            elif how == "weighted":
                out.append(mean_finite(window_max_over_avg(b), weights=b.sum(axis=0)))
            else:
                out.append(_mean([mean_finite(window_max_over_avg(b[list(t)]))
                                  for t in itertools.combinations(range(len(b)), 3)]))
        return _mean(out)

    rr, dp = "dual-path", "dualpath"
    first = bal[dp][0] if bal[dp] else None
    window_s = first.utilization_bin_s if first is not None else 0.0
    nodes = len(first.storage_read_bytes_by_node) if first is not None else 0
    # The series of the largest run: per window, and the attention bins of the first 5%.
    last = {m: bal[m][-1] for m in BALANCE_MODES if bal[m]}
    n_last = agents[-1]
    snic_rows: list[list[object]] = []
    attn_rows: list[list[object]] = []
    snic_plot: dict[str, tuple[list[float], list[float]]] = {}
    attn_plot: dict[str, tuple[list[float], list[float]]] = {}
    for m, r in last.items():
        ts = [(i + 0.5) * r.utilization_bin_s for i in range(len(r.snic_window_series))]
        snic_plot[BALANCE_MODES[m]] = (ts, list(r.snic_window_series))
        window_bytes = _snic_window_bytes(r)
        for i, v in enumerate(r.snic_window_series):
            gbps = [float(v) / r.utilization_bin_s / 1e9 for v in window_bytes[:, i]]
            snic_rows.append([n_last, m, ts[i], v, *gbps])
        k = max(1, math.ceil(FIRST_FRACTION * r.duration_s / r.attention_bin_s))
        at = [(i + 0.5) * r.attention_bin_s for i in range(min(k, len(r.attention_series)))]
        av = list(r.attention_series[:len(at)])
        attn_plot[BALANCE_MODES[m]] = (at, av)
        attn_rows += [[n_last, m, t, v] for t, v in zip(at, av, strict=True)]
    snic_csv = write_csv(ctx.path("fig13_snic_windows.csv"),
                         ["agents", "mode", "window_mid_s", "max_over_avg",
                          *[f"node{i}_read_GBps" for i in range(nodes)]], snic_rows)
    attn_csv = write_csv(ctx.path("fig14_attention_first5pct.csv"),
                         ["agents", "mode", "bin_mid_s", "attn_ran_max_over_avg"], attn_rows)
    snic_png = plots.time_series(
        ctx.path("fig13_snic_windows.png"), snic_plot, "simulated time (s)",
        f"storage-NIC bytes Max/Avg, {nodes} machines, {window_s:g} s windows",
        f"Fig. 13 storage-NIC balance, {n_last} agents",
        hlines=((1.53, "paper, round robin"), (1.18, "paper, DualPath")))
    attn_png = plots.time_series(
        ctx.path("fig14_attention_first5pct.png"), attn_plot, "simulated time (s)",
        "attention Max/Avg, engines that ran",
        f"Fig. 14 attention balance, first 5% of the run, {n_last} agents",
        hlines=((1.06, "paper, DualPath"),))
    btab = [
        [f"storage-NIC traffic Max/Avg across the {nodes} machines per {window_s:g} s window, "
         "mean over windows with reads",
         f"{snic(rr, 'mean'):.2f}", f"{snic(dp, 'mean'):.2f}", "1.53 -> 1.18 (three machines)"],
        ["the same, windows weighted by the bytes read in them",
         f"{snic(rr, 'weighted'):.2f}", f"{snic(dp, 'weighted'):.2f}", "-"],
        [f"the same as the first, across three machines (mean over every three of the {nodes})",
         f"{snic(rr, 'triples'):.2f}", f"{snic(dp, 'triples'):.2f}", "1.53 -> 1.18"],
        ["attention-time Max/Avg across an EP group's engines that ran, first 5% of the run",
         f"{avg(rr, 'attention_ran_max_over_avg_first5'):.2f}",
         f"{avg(dp, 'attention_ran_max_over_avg_first5'):.2f}", "as low as 1.06 (DualPath)"],
        ["the same, whole run", f"{avg(rr, 'attention_ran_max_over_avg'):.2f}",
         f"{avg(dp, 'attention_ran_max_over_avg'):.2f}", "-"],
        ["engines that ran per synchronized step (of the group's "
         f"{_group_size(name)})", f"{avg(rr, 'attention_engines_ran_mean'):.1f}",
         f"{avg(dp, 'attention_engines_ran_mean'):.1f}", "-"],
    ]
    body = ("\n\n### Figs. 13-14: load balance, round robin vs DualPath scheduling\n\n"
            f"**Paper:** {CLAIMS['fig13']} {CLAIMS['fig14']}\n\n"
            "Both runs have layerwise prefill and dual-path reads; only the scheduler differs "
            f"(agents {', '.join(map(str, agents))}; values are means over them). The metrics "
            "follow the paper's definitions as far as its text gives them:\n\n"
            f"- **Storage-NIC traffic Max/Avg (Fig. 13)**: per {window_s:g} s window of "
            "simulated time, the bytes each machine's storage NICs read in it, the largest "
            f"machine's over the mean of all {nodes} machines; summarised as the mean over the "
            "windows in which any machine read. The paper plots three machines and does not "
            "say which; we take every machine of the cluster.\n"
            "- **Attention-time Max/Avg (Fig. 14)**: per synchronized prefill step of an EP "
            "group (one node's engines), the slowest engine's attention time over the mean, "
            "taken across the engines that had requests in that step (an engine with none "
            "joins the step but is not counted); the mean over the steps started in the first "
            "5% of the run's duration (the paper's window), and over every step. Steps where "
            "one engine ran count as 1.0, so the engines-per-step row says how full the "
            "groups were.\n\n"
            + md_table(["metric", "round robin", "DualPath", "paper"], btab)
            + f"\n\nSeries of the {n_last}-agent runs: `fig13_snic_windows.csv` (per window "
            "and machine, GB/s) and `fig14_attention_first5pct.csv` (per "
            f"{first.attention_bin_s if first is not None else 1.0:g} s of step starts).")
    rr_snic, dp_snic = avg(rr, "snic_window_max_over_avg"), avg(dp, "snic_window_max_over_avg")
    dp_first5 = avg(dp, "attention_ran_max_over_avg_first5")
    claims = (
        Claim("Fig. 13: storage-NIC traffic Max/Avg, round robin -> DualPath", "1.53 -> 1.18",
              f"{rr_snic:.2f} -> {dp_snic:.2f}",
              within(rr_snic, 1.53, 0.15) and within(dp_snic, 1.18, 0.15),
              "both within 15%", f"per {window_s:g} s window across all {nodes} machines "
              "(the paper: three machines, unnamed)"),
        Claim("Fig. 14: attention-time Max/Avg in the first 5% (DualPath)", "1.06",
              f"{dp_first5:.2f}", dp_first5 <= 1.06 * 1.10,
              "at most 10% above (across the engines that ran in each step)",
              "prefill engines wait for work: the fitted decode sequence cap binds the run, "
              "so turns reach prefill only as decoding ones end and the compute quota that "
              "balances attention rarely binds (notes item 2; Fig. 12 addendum)"),
    )
    return body, (snic_csv, attn_csv, snic_png, attn_png), claims


def _snic_window_bytes(r: SimResult) -> npt.NDArray[np.float64]:
    """Bytes each machine's storage NICs read per window: machines x windows."""
    cap = r.resources["snic_read"].capacity_bytes_per_s * r.utilization_bin_s
    return np.asarray(r.storage_read_series_by_node, dtype=np.float64) * cap


def _group_size(name: str) -> int:
    """Engines of one synchronized prefill group (one node) of the setup."""
    return setup(name).cluster().hardware.gpus_per_node


def _mean(v: Sequence[float]) -> float:
    return sum(v) / len(v) if v else 0.0
