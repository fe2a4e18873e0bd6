"""Offline experiments (n agents start together; JCT when all finish): Fig. 7, Fig. 8, Fig. 9
and Table 3 (offline half); the Fig. 12 ablation is `ablation`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from dualpath.plan.runner import NOMINAL_STORAGE, RunSpec
from dualpath.plan.section import Claim, Context, Section, fmt, md_table, within, write_csv
from dualpath.plan.setups import setup
from dualpath.reproduce import plots
from dualpath.reproduce.paper import CLAIMS, SYSTEMS, fig7_point

FIG7_SETUPS = ("ds660b_2p4d", "ds27b_1p1d", "qwen32b_1p2d")
PAPER_AGENTS = (512, 1024, 2048, 4096)


def pick(override: Sequence[str] | Sequence[int], default: Sequence[object]) -> list[object]:
    """The user's override (`--agents`, `--mal`, `--setups`) if given, else the default."""
    return list(override) if override else list(default)


def fig7(ctx: Context) -> Section:
    """Fig. 7: offline JCT vs agents x MAL, Oracle / DualPath / Basic, side by side with the
    paper's values, and the DualPath/Basic and DualPath/Oracle ratios."""
    started = time.perf_counter()
    setups = [str(s) for s in pick(ctx.setups, FIG7_SETUPS)]
    agents = [int(str(a)) for a in pick(ctx.agents, (512,) if ctx.is_quick else PAPER_AGENTS)]
    mals = [str(m) for m in pick(ctx.mals, ("32k", "64k") if ctx.is_quick
                                  else ("32k", "48k", "64k"))]
    rows: list[list[object]] = []
    files = []
    body = [f"**Paper:** {CLAIMS['fig7']}", ""]

    def mals_of(name: str) -> list[str]:
        # Quick runs keep Qwen (no paper values to compare) to one MAL column.
        return mals[-1:] if ctx.is_quick and not ctx.mals and name == "qwen32b_1p2d" else mals

    ctx.runner.prefetch(RunSpec(name, m, n, mal, storage=st) for name in setups
                        for mal in mals_of(name) for n in agents for m in SYSTEMS
                        for st in (None, NOMINAL_STORAGE) if st is None or m != "oracle")
    for name in setups:
        mals_here = mals_of(name)
        cats: list[str] = []
        sim: dict[str, list[float]] = {s: [] for s in SYSTEMS}
        pap: dict[str, list[float | None]] = {s: [] for s in SYSTEMS}
        table = []
        for mal in mals_here:
            for n in agents:
                res = {m: ctx.runner.run(RunSpec(name, m, n, mal)).jct_s for m in SYSTEMS}
                nom = {m: ctx.runner.run(RunSpec(name, m, n, mal, storage=NOMINAL_STORAGE)).jct_s
                       if m != "oracle" else res[m] for m in SYSTEMS}
                p = fig7_point(name, n, mal)
                paper = {m: (p.jct_s.get(m) if p else None) for m in SYSTEMS}
                cats.append(f"{n}\n{mal}")
                for m in SYSTEMS:
                    sim[m].append(res[m])
                    pap[m].append(paper[m])
                    rows.append([name, n, mal, m, res[m], paper[m] if paper[m] else "", nom[m]])
                sp = res["basic"] / res["dualpath"]
                sp_nom = nom["basic"] / nom["dualpath"]
                gap = res["dualpath"] / res["oracle"]
                psp = (paper["basic"] / paper["dualpath"]
                       if paper["basic"] and paper["dualpath"] else None)
                pgap = (paper["dualpath"] / paper["oracle"]
                        if paper["oracle"] and paper["dualpath"] else None)
                table.append([n, mal] + [f"{fmt(res[m])} / {fmt(paper[m])}" for m in SYSTEMS]
                             + [f"{sp:.2f}x / {fmt(psp, 2)}x", f"{gap:.2f}x / {fmt(pgap, 2)}x",
                                f"{fmt(nom['dualpath'])} / {fmt(nom['basic'])} "
                                f"({sp_nom:.2f}x)"])
        png = plots.grouped_bars(
            ctx.path(f"fig7_{name}.png"), cats, sim, "JCT (s)",
            f"Fig. 7 offline JCT, {setup(name).label}", paper=pap, xlabel="agents / MAL",
        )
        files.append(png)
        body += [f"### {setup(name).label}", "",
                 "Each cell: simulated / paper (s), storage at the calibrated read rate. "
                 "Speedup = Basic/DualPath; gap = DualPath/Oracle; the last column re-runs "
                 "DualPath / Basic with the storage NICs at their nominal line rate.", "",
                 md_table(["agents", "MAL", "Oracle", "DualPath", "Basic", "speedup",
                           "gap to Oracle", "nominal storage: DualPath / Basic (speedup)"],
                          table), ""]
    files.insert(0, write_csv(ctx.path("fig7.csv"),
                              ["setup", "agents", "mal", "mode", "sim_jct_s", "paper_jct_s",
                               "sim_jct_nominal_storage_s"], rows))
    claims = fig7_claims(rows)
    body += ["### Claims checked", "",
             *(f"- {c.claim}: {c.ours} (paper {c.paper}): **{'pass' if c.is_pass else 'FAIL'}**"
               for c in claims)]
    return Section("fig7", "Fig. 7: offline JCT", "\n".join(body), tuple(files),
                   time.perf_counter() - started, ctx.scale, tuple(claims))


PAPER_MAX_SPEEDUP = {"ds660b_2p4d": 1.87, "ds27b_1p1d": 1.78}


def fig7_claims(rows: Sequence[Sequence[object]]) -> list[Claim]:
    """Fig. 7's claims from its CSV rows: the largest speedup per setup and DS 27B's gap to
    Oracle, each against the paper's over the same cells where it has them (its stated
    figure otherwise), and the 64K bands (DS 660B 1.6-2.1x and within 15% of Oracle at
    1,024-4,096 agents)."""
    jct: dict[tuple[str, int, str], dict[str, float]] = {}
    paper: dict[tuple[str, int, str], dict[str, float]] = {}
    for name, n, mal, mode, sim, ref, *_ in rows:
        key = (str(name), int(str(n)), str(mal))
        jct.setdefault(key, {})[str(mode)] = float(str(sim))
        if ref not in ("", None):
            paper.setdefault(key, {})[str(mode)] = float(str(ref))

    def ratios(name: str, num: str, den: str, of: dict[tuple[str, int, str],
                                                      dict[str, float]]) -> list[float]:
        return [v[num] / v[den] for k, v in of.items()
                if k[0] == name and k in jct and num in v and den in v]

    out = []
    for name, stated in PAPER_MAX_SPEEDUP.items():
        theirs = ratios(name, "basic", "dualpath", paper)
        sps = [(v["basic"] / v["dualpath"], k) for k, v in jct.items()
               if k[0] == name and (not theirs or k in paper)]
        if sps:
            best, (_, n, mal) = max(sps)
            ref = max(theirs) if theirs else stated
            where = "over the same cells" if theirs else "stated"
            out.append(Claim(f"{setup(name).label}: offline speedup over Basic up to",
                             f"{ref:.2f}x ({where})", f"{best:.2f}x ({n} agents, {mal})",
                             within(best, ref, 0.15), "within 15%"))
    theirs = ratios("ds27b_1p1d", "dualpath", "oracle", paper)
    gaps = [v["dualpath"] / v["oracle"] for k, v in jct.items()
            if k[0] == "ds27b_1p1d" and (not theirs or k in paper)]
    if gaps:
        lo, hi = (min(theirs), max(theirs)) if theirs else PAPER_DS27B_GAP
        out.append(Claim("DS 27B 1P1D: DualPath slower than Oracle by",
                         f"{lo:.2f}-{hi:.2f}x" + (" (same cells)" if theirs else ""),
                         f"{min(gaps):.2f}-{max(gaps):.2f}x",
                         min(gaps) >= lo * 0.85 and max(gaps) <= hi * 1.15,
                         "our range inside the paper's, widened by 15%"))
    for name, (lo, hi, gap_max, (a_lo, a_hi)) in ACCEPTANCE.items():
        for (_, n, _), v in sorted((k, v) for k, v in jct.items()
                                   if k[0] == name and k[2] == "64k" and a_lo <= k[1] <= a_hi):
            sp = v["basic"] / v["dualpath"]
            out.append(Claim(f"{setup(name).label} 64K {n} agents: DualPath/Basic",
                             f"{lo}-{hi}x", f"{sp:.2f}x", lo <= sp <= hi, "inside the band"))
            if gap_max is not None:
                gap = v["dualpath"] / v["oracle"] - 1.0
                out.append(Claim(f"{setup(name).label} 64K {n} agents: DualPath close to Oracle",
                                 f"within {100 * gap_max:.0f}%", f"{100 * gap:+.1f}%",
                                 gap <= gap_max, f"DualPath/Oracle - 1 <= {gap_max:g}"))
    return out


ACCEPTANCE = {
    # setup: (speedup low, speedup high, max DualPath/Oracle - 1 or None, agents range): the
    # band the paper's DS 660B 64K cells span, and "close to Oracle" as within 15%.
    "ds660b_2p4d": (1.6, 2.1, 0.15, (1024, 4096)),
}
PAPER_DS27B_GAP = (1.09, 1.85)
"""DS 27B 1P1D: DualPath "still 1.09-1.85x slower than Oracle" (1P1D storage bandwidth)."""


FIG8_1P2D_CAUSE = ("our DualPath 1P2D is faster than the paper's (its one prefill node fed by "
                   "three storage NICs; 2P1D's one decode node binds ours); what slows the "
                   "paper's is not found (full/fig8 addendum)")
"""Known cause of the Fig. 8 failures that come from DualPath 1P2D (notes item 3)."""


def fig8(ctx: Context) -> Section:
    """Fig. 8: P/D ratios 1P1D, 2P1D, 1P2D on DS 27B, Basic vs DualPath."""
    started = time.perf_counter()
    pds = ((1, 1), (2, 1), (1, 2))
    agents = [int(str(a)) for a in pick(ctx.agents, (512,) if ctx.is_quick
                                         else (512, 1024, 2048))]
    mals = [str(m) for m in pick(ctx.mals, ("32k",) if ctx.is_quick else ("32k", "48k", "64k"))]
    rows: list[list[object]] = []
    cats: list[str] = []
    series: dict[str, list[float]] = {}
    speedups = []
    speedup_pd: list[str] = []
    ctx.runner.prefetch(RunSpec("ds27b_1p1d", m, n, mal, num_prefill_nodes=p, num_decode_nodes=d)
                        for mal in mals for n in agents for p, d in pds
                        for m in ("basic", "dualpath"))
    for mal in mals:
        for n in agents:
            cats.append(f"{n}\n{mal}")
            for p, d in pds:
                jct = {}
                for m in ("basic", "dualpath"):
                    r = ctx.runner.run(RunSpec("ds27b_1p1d", m, n, mal, num_prefill_nodes=p,
                                               num_decode_nodes=d))
                    jct[m] = r.jct_s
                    series.setdefault(f"{m} {p}P{d}D", []).append(r.jct_s)
                    rows.append([f"{p}P{d}D", n, mal, m, r.jct_s])
                speedups.append(jct["basic"] / jct["dualpath"])
                speedup_pd.append(f"{p}P{d}D")
    png = plots.grouped_bars(ctx.path("fig8.png"), cats, series, "JCT (s)",
                             "Fig. 8 P/D ratio, DS 27B offline", xlabel="agents / MAL")
    csvp = write_csv(ctx.path("fig8.csv"), ["pd", "agents", "mal", "mode", "sim_jct_s"], rows)
    tab = [[r[0], r[1], r[2], r[3], fmt(float(str(r[4])))] for r in rows]
    pairs = []
    mean_sp, max_sp = sum(speedups) / len(speedups), max(speedups)
    max_pd = speedup_pd[speedups.index(max_sp)]
    claims = [Claim("Fig. 8 (DS 27B P/D ratios): average DualPath/Basic speedup", "1.64x",
                    f"{mean_sp:.2f}x", within(mean_sp, 1.64, 0.15), "within 15%"),
              Claim("Fig. 8: largest speedup", "2.46x",
                    f"{max_sp:.2f}x ({max_pd})", within(max_sp, 2.46, 0.15), "within 15%",
                    FIG8_1P2D_CAUSE if max_sp > 2.46 and max_pd == "1P2D" else "")]
    for a, b in ((("dualpath", "1P1D"), ("basic", "2P1D")), (("dualpath", "2P1D"),
                 ("dualpath", "1P2D")), (("basic", "1P1D"), ("basic", "1P2D"))):
        xa = series[f"{a[0]} {a[1]}"]
        xb = series[f"{b[0]} {b[1]}"]
        ratio = sum(u / v for u, v in zip(xa, xb, strict=True)) / len(xa)
        pairs.append(f"- {a[0]} {a[1]} / {b[0]} {b[1]} JCT: {ratio:.2f} (paper: about 1)")
        claims.append(Claim(f"Fig. 8: {a[0]} {a[1]} performs like {b[0]} {b[1]} (equal "
                            "available storage bandwidth)", "JCT ratio ~1",
                            f"{ratio:.2f}", within(ratio, 1.0, 0.10), "within 10%",
                            FIG8_1P2D_CAUSE if b == ("dualpath", "1P2D") and ratio > 1.0
                            else ""))
    body = (f"**Paper:** {CLAIMS['fig8']}\n\n"
            f"Simulated DualPath/Basic speedup: mean {sum(speedups) / len(speedups):.2f}x, "
            f"max {max(speedups):.2f}x over {len(speedups)} (agents, MAL, P/D) points.\n\n"
            "Pairs the paper says perform alike (equal available storage bandwidth), mean JCT "
            "ratio:\n\n" + "\n".join(pairs) + "\n\n"
            + md_table(["P/D", "agents", "MAL", "mode", "JCT s"], tab))
    return Section("fig8", "Fig. 8: P/D ratio (DS 27B)", body, (csvp, png),
                   time.perf_counter() - started, ctx.scale, tuple(claims))


FIG9_FACTORS = (1.0, 1.5, 2.0, 3.0)
"""Fig. 9's append and generation scales: the paper's figure compares 1.5x, 2x and 3x with
Fig. 7's cell at 1x (the digest gives no values for them)."""


def fig9(ctx: Context) -> Section:
    """Fig. 9: append- and generation-length scaling on DS 660B 2P4D at 64K MAL."""
    started = time.perf_counter()
    n = int(ctx.agents[0]) if ctx.agents else (64 if ctx.is_quick else 1024)
    name = "ds660b_2p4d"
    factors = FIG9_FACTORS
    rows: list[list[object]] = []
    files = []
    body = [f"**Paper:** {CLAIMS['fig9']}", "", f"{setup(name).label}, 64K MAL, {n} agents.", ""]
    ctx.runner.prefetch(RunSpec(name, m, n, "64k", append_factor=f) for f in factors
                        for m in SYSTEMS)
    ctx.runner.prefetch(RunSpec(name, m, n, "64k", gen_factor=f) for f in factors
                        for m in SYSTEMS)
    speedups: dict[str, list[float]] = {"append": [], "gen": []}
    append_jct: list[dict[str, float]] = []
    for kind in ("append", "gen"):
        series: dict[str, list[float | None]] = {m: [] for m in SYSTEMS}
        tab = []
        for f in factors:
            spec = {"append_factor": f} if kind == "append" else {"gen_factor": f}
            jct = {m: ctx.runner.run(RunSpec(name, m, n, "64k", **spec)).jct_s  # type: ignore[arg-type]
                   for m in SYSTEMS}
            for m in SYSTEMS:
                series[m].append(jct[m])
                rows.append([kind, f, m, jct[m]])
            tab.append([f"{f:g}x"] + [fmt(jct[m]) for m in SYSTEMS]
                       + [f"{jct['basic'] / jct['dualpath']:.2f}x"])
            speedups[kind].append(jct["basic"] / jct["dualpath"])
            if kind == "append":
                append_jct.append(jct)
        files.append(plots.lines(ctx.path(f"fig9_{kind}.png"), list(factors), series,
                                 f"{kind} length scale factor (x Table 2)", "JCT (s)",
                                 f"Fig. 9 {kind}-length scaling, {setup(name).label}, {n} agents"))
        body += [f"### {kind} length", "",
                 md_table([f"{kind} scale", "Oracle s", "DualPath s", "Basic s", "speedup"], tab),
                 ""]
    files.insert(0, write_csv(ctx.path("fig9.csv"), ["kind", "factor", "mode", "sim_jct_s"],
                              rows))
    append_sp, gen_sp = speedups["append"], speedups["gen"]
    lo, hi = min(append_sp), max(append_sp)

    def falls(values: list[float]) -> bool:
        return all(b <= a for a, b in itertools.pairwise(values))

    fall = {m: 100.0 * (1.0 - append_jct[-1][m] / append_jct[0][m]) for m in SYSTEMS}
    claims = (
        Claim(f"Fig. 9 (DS 660B 64K, {n} agents): speedup across append scales", "1.82-1.99x",
              f"{lo:.2f}-{hi:.2f}x", lo >= 1.82 * 0.9 and hi <= 1.99 * 1.1,
              "every scale within 10% of the paper's range",
              f"from {factors[0]:g}x to {factors[-1]:g}x append our Oracle and DualPath JCTs "
              f"fall {fall['oracle']:.0f}% and {fall['dualpath']:.0f}%, where the paper's "
              f"'change only slightly', and Basic {fall['basic']:.0f}%: fewer turns fit under "
              "the MAL, and the JCT is the last agent's; our trajectories match Table 2's "
              "averages, not the paper's longest ones (notes item 1)"),
        Claim("Fig. 9: Basic approaches DualPath as append grows", "speedup falls",
              " -> ".join(f"{v:.2f}x" for v in append_sp), falls(append_sp),
              "speedup non-increasing in the append scale"),
        Claim("Fig. 9: the generation-length trend is similar (DualPath gains most with short "
              "generations)", "speedup falls", " -> ".join(f"{v:.2f}x" for v in gen_sp),
              falls(gen_sp), "speedup non-increasing in the generation scale"),
    )
    return Section("fig9", "Fig. 9: append and generation length", "\n".join(body), tuple(files),
                   time.perf_counter() - started, ctx.scale, claims)


def unit_ep_engines() -> tuple[int, int]:
    """(prefill, decode) engines of the 2P4D unit: Table 3's large clusters shard MoE weights
    over groups of that size, as copies of the unit would, not over their whole sides (the
    paper scaled out without tuning parallelism, §7.6)."""
    unit = setup("ds660b_2p4d").cluster()
    return unit.num_prefill_engines, unit.num_decode_engines


def table3_offline_specs(ctx: Context, k: int) -> tuple[RunSpec, RunSpec]:
    """Table 3's offline runs: 2P4D with n agents, (2k)P(4k)D with k*n agents."""
    n = ctx.agents[0] if ctx.agents else (128 if ctx.is_quick else 512)
    return (RunSpec("ds660b_2p4d", "dualpath", n, "64k"),
            RunSpec("ds660b_2p4d", "dualpath", k * n, "64k", num_prefill_nodes=2 * k,
                    num_decode_nodes=4 * k, ep_engines=unit_ep_engines()))


def table3_offline(ctx: Context, k: int) -> tuple[list[list[object]], float, float]:
    """2P4D with n agents vs (2k)P(4k)D with k*n agents: rows and the two DualPath JCTs. The
    large cluster keeps the small one's expert-parallel groups (`unit_ep_engines`)."""
    specs = table3_offline_specs(ctx, k)
    ctx.runner.prefetch(specs)
    small, big = (ctx.runner.run(s) for s in specs)
    n = specs[0].num_agents
    rows: list[list[object]] = [
        ["offline", "2P4D", n, "", small.jct_s, small.num_completed],
        ["offline", f"{2 * k}P{4 * k}D", k * n, "", big.jct_s, big.num_completed],
    ]
    return rows, small.jct_s, big.jct_s
