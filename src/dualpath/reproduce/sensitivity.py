"""The storage read model: what was fitted, on which cells, how each form carries the fit to
other block sizes, and every Fig. 7 residual split into fitted and predicted; beside the
packaged form, every cell again under the other candidate form (`flat` or the 3FS-derived
`queued`) at the same fitted rate, so a change of form shows what it moves.

Basic reads every hit token through the prefill nodes' storage NICs only, so a Basic JCT fixes
the mean rate at which those NICs moved KV over the run: (hit tokens of the workload x KV bytes
per token) / JCT / prefill nodes. DualPath reads through every node's storage NIC, so its JCT
fixes the mean over all nodes (a lower bound on what a NIC could move where DualPath runs close
to Oracle). The section computes both from the paper's JCTs and from ours, at the calibrated
rate and at the nominal line rate (which stays in the report as a column).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from dualpath.core.read_rate import STORAGE_FORMS, StorageReadModel
from dualpath.plan.runner import (
    NOMINAL_STORAGE,
    RunSpec,
    block_bytes,
    run_storage,
    storage_fraction,
)
from dualpath.plan.section import Context, Section, md_table, write_csv
from dualpath.plan.setups import setup
from dualpath.plan.storage_note import FIT_SETUP
from dualpath.reproduce import plots
from dualpath.reproduce.calibrate import rms_of
from dualpath.reproduce.paper import fig7_point
from dualpath.reproduce.storage_fit import (
    FIT_CELLS,
    FIT_SYSTEM,
    FORM,
    STORAGE_RECORD,
    fits_from_json,
    model_of,
    packaged_model,
)

SETUPS = ("ds660b_2p4d", "ds27b_1p1d")
BLOCK_SETUPS = ("ds27b_1p1d", "ds660b_2p4d", "qwen32b_1p2d")
SYSTEMS = ("basic", "dualpath")


def _rate_pct(model: StorageReadModel, name: str) -> float:
    return 100.0 * storage_fraction(model, name)


def other_form(model: StorageReadModel) -> StorageReadModel:
    """The candidate form the packaged one is compared with, at the same fitted rate: the
    3FS-derived `queued` form beside a `flat` or `per_block` record, `flat` beside `queued`."""
    fraction = storage_fraction(model, FIT_SETUP)
    return model_of("flat" if model.form == "queued" else "queued", fraction)


def _storage_of(model: StorageReadModel, name: str) -> tuple[float, float] | None:
    """`RunSpec.storage` that reads `name`'s blocks as `model` does (the simulator sees one
    rate per node, that of the model's block size); None where that is the packaged rate
    (the fitted setup's: the same runs)."""
    spec = run_storage(model, name)
    return None if math.isclose(spec[0], storage_fraction(packaged_model(), name)) else spec


def _is_fitted(name: str, system: str, agents: int, mal: str) -> bool:
    return name == FIT_SETUP and system == FIT_SYSTEM and (agents, mal) in FIT_CELLS


def storage_section(ctx: Context) -> Section:
    """The packaged storage model, its fit, and Fig. 7 residuals fitted vs predicted."""
    started = time.perf_counter()
    model = packaged_model()
    agents: Sequence[int] = ctx.agents or ((512, 1024) if ctx.is_quick else (1024, 2048))
    mals: Sequence[str] = ctx.mals or ("32k", "64k")
    setups = ctx.setups or SETUPS
    alt = other_form(model)
    specs = [RunSpec(name, m, n, mal, storage=st) for name in setups for n in agents
             for mal in mals for m in SYSTEMS
             for st in (None, NOMINAL_STORAGE, _storage_of(alt, name))]
    ctx.runner.prefetch(specs)
    # -- the forms --------------------------------------------------------------------------
    record = ctx.path(STORAGE_RECORD)
    fits = fits_from_json(record.read_text(encoding="utf-8")) if record.exists() else []

    def form_row(name: str, m: StorageReadModel, rms: str) -> list[object]:
        return [name, m.describe().split(": ", 1)[1], rms,
                *(f"{_rate_pct(m, s):.0f}%" for s in BLOCK_SETUPS)]

    forms = [form_row(f.form + (" (recorded)" if f.form == FORM else ""), f.model,
                      f"{f.rms_log_after:.3f}") for f in fits]
    # A form the record does not hold (or every form, without a record): at the packaged
    # model's rate for the fitted block, which is what a fit of that form gives.
    fraction = storage_fraction(model, FIT_SETUP)
    in_record = {f.form for f in fits}
    forms += [form_row(f + (" (packaged)" if f == model.form else " (at the fitted rate)"),
                       model if f == model.form else model_of(f, fraction), "-")
              for f in STORAGE_FORMS if f not in in_record]
    # -- residuals and implied rates ----------------------------------------------------------
    rows: list[list[object]] = []
    resid: dict[tuple[bool, bool | None], list[float]] = {}
    """(fitted cell?, True: packaged form / False: nominal / None: the other form)."""
    rate_tab: list[list[object]] = []
    alt_tab: list[list[object]] = []
    for name in setups:
        cl = setup(name).cluster()
        nominal = cl.hardware.storage_nic_bytes_per_s
        for n in agents:
            for mal in mals:
                p = fig7_point(name, n, mal)
                alt_st = _storage_of(alt, name)
                res = {(m, st): ctx.runner.run(RunSpec(name, m, n, mal, storage=st))
                       for m in SYSTEMS for st in (None, NOMINAL_STORAGE, alt_st)}
                for m in SYSTEMS:
                    paper = p.jct_s.get(m) if p else None
                    cal, nom = res[(m, None)].jct_s, res[(m, NOMINAL_STORAGE)].jct_s
                    other = res[(m, alt_st)].jct_s
                    fitted = _is_fitted(name, m, n, mal)
                    rows.append([name, n, mal, m, "fitted" if fitted else "predicted", cal, nom,
                                 other, paper or ""])
                    alt_tab.append([setup(name).label, n, mal, m, f"{cal:,.0f}",
                                    f"{other:,.0f}", f"{paper:,.0f}" if paper else "-",
                                    _pct(cal, paper), _pct(other, paper)])
                    if paper:
                        resid.setdefault((fitted, None), []).append(math.log(other / paper))
                        resid.setdefault((fitted, True), []).append(math.log(cal / paper))
                        resid.setdefault((fitted, False), []).append(math.log(nom / paper))
                if mal != "64k" or p is None:
                    continue
                cfg = RunSpec(name, "basic", n, mal).config()
                hit = float(cfg.workload.hit_tokens.sum()) * cl.model.kv_bytes_per_token

                def pct(nbytes: float, jct: float | None, nodes: int,
                        nominal: float = nominal) -> str:
                    return f"{100 * nbytes / jct / nodes / nominal:.0f}%" if jct else "-"

                b, d = res[("basic", None)], res[("dualpath", None)]
                bn, dn = res[("basic", NOMINAL_STORAGE)], res[("dualpath", NOMINAL_STORAGE)]
                rate_tab.append([
                    setup(name).label, n, f"{hit / 1e12:,.0f} TB",
                    pct(hit, p.jct_s.get("basic"), cl.num_prefill_nodes),
                    pct(hit, b.jct_s, cl.num_prefill_nodes), pct(hit, bn.jct_s,
                                                                 cl.num_prefill_nodes),
                    pct(hit, p.jct_s.get("dualpath"), cl.num_nodes),
                    pct(hit, d.jct_s, cl.num_nodes), pct(hit, dn.jct_s, cl.num_nodes),
                ])
    csvp = write_csv(ctx.path("storage.csv"),
                     ["setup", "agents", "mal", "mode", "role", "sim_jct_s",
                      "sim_jct_nominal_storage_s", f"sim_jct_{alt.form}_form_s", "paper_jct_s"],
                     rows)
    png = plots.grouped_bars(
        ctx.path("storage_residuals.png"), ["fitted cells", "predicted cells"],
        {"calibrated rate": [_rms(resid.get((True, True))), _rms(resid.get((False, True)))],
         "nominal rate": [_rms(resid.get((True, False))), _rms(resid.get((False, False)))]},
        "RMS log residual vs paper", "Fig. 7 residuals (Basic, DualPath), fitted vs predicted")
    res_tab = [[role, f"{len(resid.get((fitted, True), []))}",
                f"{_rms(resid.get((fitted, True))):.3f}", _worst(resid.get((fitted, True))),
                f"{_rms(resid.get((fitted, None))):.3f}", _worst(resid.get((fitted, None))),
                f"{_rms(resid.get((fitted, False))):.3f}", _worst(resid.get((fitted, False)))]
               for role, fitted in (("fitted", True), ("predicted", False))]
    body = (
        f"**Packaged model** (`data/storage_calibration.json`, hardware h800-deepseek): "
        f"{model.describe()}. Source: {model.source}\n\n"
        f"The fit uses only {FIT_SETUP} {FIT_SYSTEM} at (agents, MAL) {list(FIT_CELLS)}; "
        "every other cell is a prediction. Those cells hold one block size, so they fix one "
        "number, the read rate of a 1.39 MB Full Block; the forms below read it equally "
        "and differ for other models' blocks (rate as % of the 400 Gb/s line rate). The "
        "`queued` form's latency, stream rate and cap come from 3FS's published reads "
        "(deepseek-ai/3FS#410; `dualpath.core.read_rate`); only its reads in flight are "
        "fitted:\n\n"
        + md_table(["form", "parameters", "fitted RMS log",
                    *(f"rate, {setup(s).label} blocks ({block_bytes(s) / 1e6:.2f} MB)"
                      for s in BLOCK_SETUPS)], forms)
        + "\n\nFig. 7 residuals of this scale's runs (Basic and DualPath; Oracle is the "
        "cost-model calibration's), fitted and predicted apart, at the packaged form's "
        f"rate, at the {alt.form} form's and at the nominal line rate:\n\n"
        + md_table(["cells", "count", "RMS log (calibrated)", "worst (calibrated)",
                    f"RMS log ({alt.form} form)", f"worst ({alt.form} form)",
                    "RMS log (nominal)", "worst (nominal)"], res_tab)
        + f"\n\nEach cell under the packaged ({model.form}) form and under the {alt.form} "
        "form at the same fitted rate (simulated JCT, s; error against the paper):\n\n"
        + md_table(["setup", "agents", "MAL", "system", model.form, alt.form, "paper",
                    f"error ({model.form})", f"error ({alt.form})"], alt_tab)
        + "\n\nMean storage read rate over the run as % of the line rate, as the paper's JCTs "
        "imply it (our trace's hit KV / JCT / reading nodes) and as ours move it:\n\n"
        + md_table(["setup", "agents", "hit KV read", "paper Basic", "our Basic",
                    "our Basic (nominal)", "paper DualPath", "our DualPath",
                    "our DualPath (nominal)"], rate_tab)
    )
    return Section("storage", "Storage read model: fit and residuals", body, (csvp, png),
                   time.perf_counter() - started, ctx.scale)


def _pct(sim: float, paper: float | None) -> str:
    return f"{100 * (sim / paper - 1):+.0f}%" if paper else "-"


def _rms(v: Sequence[float] | None) -> float:
    return rms_of(v or [])


def _worst(v: Sequence[float] | None) -> str:
    if not v:
        return "-"
    w = max(v, key=abs)
    return f"{100 * (math.exp(w) - 1):+.0f}%"



