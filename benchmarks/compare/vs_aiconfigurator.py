"""Side by side with the planner users have today: NVIDIA's AIConfigurator and `dualpath advise`
on the same model, GPUs, lengths and SLO (issue 31, deliver 5).

1. AIConfigurator 0.12.0 (its own venv, `.venv-aic`, made on first use or by `make aic-setup`)
   runs `aiconfigurator cli default --model-path DIR --system h200_sxm --backend vllm
   --total-gpus 16 --isl 32000 --osl 400 --prefix 30000 --ttft 4000 --tpot 50`, where DIR holds
   Qwen2.5-32B's `config.json` (written here from its public shape; `--model-path` for another).
   Its best aggregated and disaggregated configurations are parsed from its printed tables.
2. The storage read rate each would need if the `--prefix` tokens of every request came from
   storage (AIConfigurator counts them as cached and free): requests/s x prefix tokens x KV
   bytes per token (our model registry), spread over the nodes whose engines read them (all
   nodes of an aggregated plan; the nodes the prefill workers fill in a disaggregated one, as
   P/D serving loads a request's KV on its prefill worker). Against what one node's storage NIC
   delivers in our simulator: the hardware preset's line rate through its storage read model
   (`dualpath.core.read_rate`; the `h200` preset has no fitted record, so its nominal 2 x 400
   Gb/s), and, for reference, the paper's node (one 400 Gb/s NIC at the read efficiency fitted
   to its Fig. 7, `h800-deepseek`).
3. Our simulator on the same 16 GPUs (every P/D split of whole nodes), same request shape
   (isl, prefix read from storage, osl), same SLO (mean TTFT, mean TPOT): the highest request
   rate meeting it per mode, searched as `dualpath advise` searches (double / halve, bisect),
   single-turn requests arriving as a Poisson process; once with the `--hardware` preset's
   storage and once with the `--reference-hardware` preset's (its NIC rate and read model on
   the same nodes).
4. `dualpath advise` itself (the function behind the command) on the same model, hardware,
   GPUs and SLO, on its own workload: the Table-2 agent trajectories of `--trace` (32K: mean
   context 17K tokens, append 608, generate 148 per turn), not AIConfigurator's fixed shape.

Run: `.venv/bin/python benchmarks/compare/vs_aiconfigurator.py` (about 3 minutes on 2 cores, of
which AIConfigurator 15-90 s and advise most of the rest; `--aic-output FILE` parses a saved
AIConfigurator output instead of running it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from dualpath.core.hardware import hardware_preset
from dualpath.core.hf_config import model_from_hf_config
from dualpath.core.model import model_preset
from dualpath.core.read_rate import StorageReadModel, storage_read_model
from dualpath.plan.advise import advise, bottleneck
from dualpath.plan.capacity import OnlinePoint, point_spec, steady_point
from dualpath.plan.runner import Runner
from dualpath.plan.section import Context
from dualpath.plan.setups import setup
from dualpath.sim import Driver, SimConfig, SimParams, SimResult, Workload, mode_preset, simulate

REPO = Path(__file__).resolve().parents[2]
AIC_VENV = REPO / ".venv-aic"
AIC_PIN = "aiconfigurator==0.12.0"
AIC_INSTALL = f"python3 -m venv {AIC_VENV.name} && {AIC_VENV.name}/bin/pip install {AIC_PIN}"

QWEN25_32B_CONFIG: dict[str, object] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 5120,
    "intermediate_size": 27648,
    "num_hidden_layers": 64,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "vocab_size": 152064,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
"""Qwen2.5-32B's shape as its public Hugging Face config.json gives it
(../shared/reference/hardware-and-models.md); the fields AIConfigurator and our registry read."""


# -- AIConfigurator's output ----------------------------------------------------------------

@dataclass(frozen=True)
class AicConfig:
    """The best configuration of one AIConfigurator experiment (`agg` or `disagg`)."""

    serving: str
    tokens_per_s_per_gpu: float
    """Output tokens per second per GPU of the cluster."""
    requests_per_s: float
    ttft_ms: float
    total_gpus: int
    prefill_gpus: int
    """GPUs that run prefill (all of them when aggregated)."""
    layout: str


_TABLE_TITLE = re.compile(r"^(agg|disagg) Top Configurations")


def parse_tables(text: str) -> dict[str, list[dict[str, str]]]:
    """AIConfigurator's printed `agg` / `disagg` Top Configurations tables: per experiment,
    one dict per row, keyed by the header's column names."""
    tables: dict[str, list[dict[str, str]]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _TABLE_TITLE.match(line.strip())
        if not m:
            continue
        body: list[list[str]] = []
        for ln in lines[i + 1:]:
            s = ln.strip()
            if not s.startswith(("|", "+")):
                break
            if s.startswith("|"):
                body.append([c.strip() for c in s.strip("|").split("|")])
        if len(body) < 2:
            raise ValueError(f"AIConfigurator output: {m.group(1)} table has no rows")
        header, data = body[0], body[1:]
        tables[m.group(1)] = [dict(zip(header, r, strict=True)) for r in data]
    return tables


def _lead_int(cell: str) -> int:
    """`16 (16=2x8)` -> 16."""
    m = re.match(r"\s*(\d+)", cell)
    if not m:
        raise ValueError(f"AIConfigurator output: {cell!r} is not a count")
    return int(m.group(1))


def _field(row: dict[str, str], name: str, serving: str) -> str:
    try:
        return row[name]
    except KeyError:
        raise ValueError(f"AIConfigurator output: {serving} table has no column {name!r} "
                         f"(columns: {', '.join(row)})") from None


def parse_aic(text: str) -> dict[str, AicConfig]:
    """The rank-1 row of each experiment AIConfigurator printed (`agg`, `disagg`)."""
    out: dict[str, AicConfig] = {}
    for serving, rows in parse_tables(text).items():
        row = next((r for r in rows if r.get("Rank") == "1"), rows[0])

        def f(name: str, row: dict[str, str] = row, serving: str = serving) -> str:
            return _field(row, name, serving)

        total = _lead_int(f("total_gpus (used)"))
        replicas = _lead_int(f("replicas"))
        if serving == "agg":
            prefill_gpus = total
            layout = f"{f('parallel')} x {replicas}"
        else:
            p_workers, d_workers = _lead_int(f("(p)workers")), _lead_int(f("(d)workers"))
            prefill_gpus = replicas * p_workers * _lead_int(f("(p)gpus/worker"))
            layout = (f"{p_workers} prefill {f('(p)parallel')} + {d_workers} decode "
                      f"{f('(d)parallel')}" + (f" x {replicas}" if replicas > 1 else ""))
        out[serving] = AicConfig(serving, float(f("tokens/s/gpu")), float(f("req/s")),
                                 float(f("TTFT")), total, prefill_gpus, layout)
    if not out:
        raise ValueError("AIConfigurator output: no 'agg/disagg Top Configurations' table")
    return out


# -- the storage reads its recommendation implies -------------------------------------------

@dataclass(frozen=True)
class StorageNeed:
    """What a plan's requests read from storage if their prefix is not in GPU memory."""

    read_bytes_per_s: float
    """All nodes together."""
    num_reading_nodes: int
    """Nodes whose storage NICs carry the reads."""

    @property
    def per_node_bytes_per_s(self) -> float:
        return self.read_bytes_per_s / self.num_reading_nodes


def storage_need(cfg: AicConfig, prefix_tokens: int, kv_bytes_per_token: float,
                 gpus_per_node: int) -> StorageNeed:
    """Requests/s x prefix x KV bytes/token, over the nodes the reading GPUs fill (an
    aggregated plan: every node it uses; a disaggregated one: the prefill workers' nodes,
    packed onto as few nodes as they fit)."""
    if prefix_tokens < 0 or kv_bytes_per_token <= 0 or gpus_per_node < 1:
        raise ValueError("prefix_tokens >= 0, kv_bytes_per_token > 0, gpus_per_node >= 1")
    nodes = max(1, math.ceil(cfg.prefill_gpus / gpus_per_node))
    return StorageNeed(cfg.requests_per_s * prefix_tokens * kv_bytes_per_token, nodes)


# -- running AIConfigurator -------------------------------------------------------------------

def aic_executable(given: str | None) -> Path:
    """`given`, else `.venv-aic/bin/aiconfigurator`, installed here on first use; a failed
    install is one line naming the command to make the venv by hand."""
    if given:
        return Path(given)
    exe = AIC_VENV / "bin" / "aiconfigurator"
    if exe.exists():
        return exe
    print(f"making {AIC_VENV.name} ({AIC_PIN})", file=sys.stderr, flush=True)
    for argv in ([sys.executable, "-m", "venv", str(AIC_VENV)],
                 [str(AIC_VENV / "bin" / "python"), "-m", "pip", "install", "-q", AIC_PIN]):
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            sys.exit(f"error: cannot install {AIC_PIN} into {AIC_VENV.name} ({last}); make "
                     f"it by hand: {AIC_INSTALL}")
    if not exe.exists():
        sys.exit(f"error: {AIC_PIN} installed no {exe}; make the venv by hand: {AIC_INSTALL}")
    return exe


def run_aic(exe: Path, model_dir: Path, args: argparse.Namespace) -> tuple[str, float]:
    """AIConfigurator's stdout and wall seconds."""
    argv = [str(exe), "cli", "default", "--model-path", str(model_dir), "--system",
            args.system, "--backend", "vllm", "--total-gpus", str(args.total_gpus), "--isl",
            str(args.isl), "--osl", str(args.osl), "--prefix", str(args.prefix), "--ttft",
            f"{args.ttft_ms:g}", "--tpot", f"{args.tpot_ms:g}", "--no-color"]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=1800)
    wall = time.perf_counter() - started
    if done.returncode:
        sys.exit(f"error: aiconfigurator failed ({done.returncode}): "
                 f"{done.stderr.strip()[-1500:]}")
    return done.stdout, wall


# -- our side ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class OurPoint:
    """One configuration of ours at the highest request rate found meeting the SLO."""

    label: str
    storage: str
    requests_per_s: float
    """Turns (requests) completed per second in the steady part."""
    output_tokens_per_s_per_gpu: float
    ttft_ms: float
    tpot_ms: float
    read_bytes_per_s_per_node: float
    """Storage bytes read per second by the busiest node."""
    limit: str
    """What broke first above this rate."""


def steady_rates(res: SimResult, num_gpus: int) -> tuple[float, float, float]:
    """(completed turns/s, output tokens/s/GPU, busiest node's storage read B/s) over the part
    of the run after its first third (as the SLO judges it)."""
    done = res.col("done_s")
    t0 = res.duration_s / 3.0
    late = done >= t0
    span = max(res.duration_s - t0, 1e-9)
    turns = float(np.count_nonzero(late)) / span
    tokens = float(res.col("gen_tokens")[late].sum()) / span / num_gpus
    read = max(res.storage_read_bytes_by_node or (0.0,)) / max(res.duration_s, 1e-9)
    return turns, tokens, read


@dataclass(frozen=True)
class Storage:
    """The storage our simulated nodes read from: a preset's NIC rate and read model."""

    label: str
    nic_bytes_per_s: float
    read: StorageReadModel

    @staticmethod
    def of(hardware: str) -> Storage:
        hw = hardware_preset(hardware)
        return Storage(hardware, hw.storage_nic_bytes_per_s, storage_read_model(hardware))

    def delivers_bytes_per_s(self, block_bytes: float) -> float:
        """One node's sustained KV read rate for Full Blocks of `block_bytes`."""
        return self.read.read_bytes_per_s(self.nic_bytes_per_s, block_bytes)


def same_shape_capacity(
    setup_name: str, pd: tuple[int, int], mode: str, storage: Storage,
    args: argparse.Namespace, guess_per_s: float, log: Callable[[str], None],
) -> tuple[float, SimResult | None, str]:
    """The highest Poisson rate of AIConfigurator-shaped requests (isl, prefix hit from
    storage, osl) meeting the SLO on `storage`, bracketed as `dualpath advise` brackets (double
    / halve from the guess, then bisect `args.steps` times); the passing run's result (None:
    none passed) and what broke first above it."""
    s = setup(setup_name)
    params = SimParams(storage_read=storage.read)
    block = params.block_size_tokens
    hit = (min(args.prefix, args.isl - 1) // block) * block
    workload = Workload.from_lists([[(args.isl, hit, args.osl)]])
    cluster = s.cluster(*pd)
    hw = cluster.hardware
    if storage.nic_bytes_per_s != hw.storage_nic_bytes_per_s:
        cluster = replace(cluster, hardware=hw.with_overrides(
            name=f"{hw.name}+storage-of-{storage.label}",
            storage_nic_bytes_per_s=storage.nic_bytes_per_s))
    passed: dict[float, SimResult] = {}
    failed: dict[float, OnlinePoint] = {}

    def meets(rate: float) -> bool:
        rate = round(rate, 4)
        cfg = SimConfig(cluster, workload, mode=mode_preset(mode),
                        driver=Driver(kind="online", num_agents=0, agents_per_s=rate,
                                      max_duration_s=args.duration, ttft_limit_s=20.0),
                        params=params, seed=0, **s.sim_kwargs())
        started = time.perf_counter()
        res = simulate(cfg)
        p = steady_point(res, rate)
        ok = p.meets_slo and p.ttft_s <= args.ttft_ms / 1e3 and p.tpot_s <= args.tpot_ms / 1e3
        log(f"  {storage.label} storage, {pd[0]}P{pd[1]}D {mode:<9} {rate:7.3f} req/s: TTFT "
            f"{p.ttft_s:6.2f} s, TPOT {1e3 * p.tpot_s:5.1f} ms, {res.stop_reason}: "
            f"{'meets' if ok else 'fails'} the SLO ({time.perf_counter() - started:.1f} s wall)")
        if ok:
            passed[rate] = res
        else:
            failed[rate] = p
        return ok

    lo, hi = 0.0, math.inf
    if meets(guess_per_s):
        lo = guess_per_s
        for k in range(1, 7):
            if not meets(guess_per_s * 2**k):
                hi = guess_per_s * 2**k
                break
            lo = guess_per_s * 2**k
    else:
        hi = guess_per_s
        for k in range(1, 7):
            if meets(guess_per_s / 2**k):
                lo = guess_per_s / 2**k
                break
            hi = guess_per_s / 2**k
    for _ in range(args.steps):
        if lo == 0 or math.isinf(hi):
            break
        mid = (lo + hi) / 2
        if meets(mid):
            lo = mid
        else:
            hi = mid
    above = [r for r in failed if r > round(lo, 4)]
    why = bottleneck(failed[min(above)] if above else None).replace(" APS", " req/s")
    return lo, passed.get(round(lo, 4)), why


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-32b", help="our model preset (default: "
                    "%(default)s)")
    ap.add_argument("--model-path", type=Path, help="folder with the HF config.json "
                    "AIConfigurator reads (default: Qwen2.5-32B's, written to a temp dir)")
    ap.add_argument("--hardware", default="h200", help="our node preset (default: %(default)s)")
    ap.add_argument("--system", default="h200_sxm", help="AIConfigurator's system (default: "
                    "%(default)s)")
    ap.add_argument("--reference-hardware", default="h800-deepseek",
                    help="a second node preset whose storage the table also shows (default: "
                    "%(default)s, the paper's)")
    ap.add_argument("--total-gpus", type=int, default=16)
    ap.add_argument("--isl", type=int, default=32000)
    ap.add_argument("--osl", type=int, default=400)
    ap.add_argument("--prefix", type=int, default=30000)
    ap.add_argument("--ttft-ms", type=float, default=4000.0)
    ap.add_argument("--tpot-ms", type=float, default=50.0)
    ap.add_argument("--trace", default="32k", choices=("32k", "48k", "64k"),
                    help="the Table-2 trace `dualpath advise` runs (default: %(default)s)")
    ap.add_argument("--modes", default="basic,dualpath")
    ap.add_argument("--duration", type=float, default=600.0,
                    help="simulated seconds per online run (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=5, help="bisection steps on its shape (default: "
                    "%(default)s)")
    ap.add_argument("--aic", metavar="EXE", help="the aiconfigurator executable (default: "
                    f"{AIC_VENV.name}/bin/aiconfigurator, installed if missing)")
    ap.add_argument("--aic-output", type=Path, metavar="FILE",
                    help="parse this saved AIConfigurator output instead of running it")
    ap.add_argument("--save-aic-output", type=Path, metavar="FILE",
                    help="keep AIConfigurator's output in this file")
    ap.add_argument("--json", type=Path, metavar="FILE", help="also write the numbers here")
    args = ap.parse_args()

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    model = model_preset(args.model)
    hw = hardware_preset(args.hardware)
    if args.total_gpus % hw.gpus_per_node or args.total_gpus < 2 * hw.gpus_per_node:
        sys.exit(f"error: --total-gpus={args.total_gpus}: must be a multiple of {args.hardware}"
                 f"'s {hw.gpus_per_node} GPUs per node, at least two nodes (P/D)")
    num_nodes = args.total_gpus // hw.gpus_per_node
    kv = model.kv_bytes_per_token

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_path
        if model_dir is None:
            model_dir = Path(tmp) / "qwen2.5-32b"
            model_dir.mkdir()
            (model_dir / "config.json").write_text(json.dumps(QWEN25_32B_CONFIG, indent=2))
        theirs = model_from_hf_config(model_dir).kv_bytes_per_token
        if theirs != kv:
            sys.exit(f"error: {model_dir}/config.json has {theirs:,.0f} KV bytes/token, our "
                     f"preset {args.model} {kv:,.0f}: give the matching --model")
        if args.aic_output:
            text, aic_wall = args.aic_output.read_text(encoding="utf-8"), math.nan
        else:
            text, aic_wall = run_aic(aic_executable(args.aic), model_dir, args)
    if args.save_aic_output:
        args.save_aic_output.write_text(text, encoding="utf-8")
    aic = parse_aic(text)

    block_bytes = kv * SimParams().block_size_tokens
    stores = [Storage.of(args.hardware), Storage.of(args.reference_hardware)]
    delivers = {st.label: st.delivers_bytes_per_s(block_bytes) for st in stores}
    needs = {k: storage_need(c, args.prefix, kv, hw.gpus_per_node) for k, c in aic.items()}

    # Our simulator, AIConfigurator's request shape, every P/D of whole nodes, each storage.
    name = f"{args.model}@{args.hardware}"
    pds = [(p, num_nodes - p) for p in range(1, num_nodes)]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    guess = min(c.requests_per_s for c in aic.values())
    started = time.perf_counter()
    ours: list[OurPoint] = []
    log(f"our simulator: {args.isl}-token requests, {args.prefix} of them read from storage, "
        f"{args.osl} generated, Poisson arrivals")
    for st in stores:
        for pd in pds:
            for mode in modes:
                rate, res, why = same_shape_capacity(name, pd, mode, st, args, guess, log)
                label = f"{pd[0]}P{pd[1]}D {mode}, {st.label} storage"
                if res is None:
                    ours.append(OurPoint(label, st.label, 0.0, 0.0, math.nan, math.nan, 0.0,
                                         why))
                    continue
                p = steady_point(res, round(rate, 4))
                turns, tokens, read = steady_rates(res, args.total_gpus)
                ours.append(OurPoint(label, st.label, turns, tokens, 1e3 * p.ttft_s,
                                     1e3 * p.tpot_s, read, why))
    same_shape_s = time.perf_counter() - started

    # `dualpath advise` on its own (Table-2) workload.
    log(f"dualpath advise: {name}, {'/'.join(f'{p}P{d}D' for p, d in pds)}, "
        f"{args.trace} trajectories")
    started = time.perf_counter()
    ctx = Context(Path(tempfile.mkdtemp(prefix="vs_aic_")), Runner(jobs=2, progress=False),
                  True, mals=(args.trace,), online_duration_s=args.duration)
    cands, _ = advise(ctx, name, pds, modes, 2)
    best = cands[0]
    bpd = (best.num_prefill_nodes, best.num_decode_nodes)
    adv_res = ctx.runner.run(point_spec(ctx, name, best.mode, best.capacity_aps, bpd))
    a_turns, a_tokens, a_read = steady_rates(adv_res, best.num_gpus)
    ap_pt = steady_point(adv_res, round(best.capacity_aps, 4))
    advise_s = time.perf_counter() - started

    def gb(x: float) -> str:
        return f"{x / 1e9:.1f}"

    main_st, ref_st = stores
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    print(f"{date}: {args.model} on {args.total_gpus} GPUs ({num_nodes} nodes x "
          f"{hw.gpus_per_node}; ours {args.hardware}, AIConfigurator {args.system}), isl "
          f"{args.isl}, prefix {args.prefix}, osl {args.osl}, SLO mean TTFT <= "
          f"{args.ttft_ms:g} ms, mean TPOT <= {args.tpot_ms:g} ms")
    print(f"KV {kv:,.0f} B/token ({args.model}): a {args.prefix}-token prefix is "
          f"{gb(args.prefix * kv)} GB")
    for st in stores:
        print(f"one node's storage, {st.label}: {gb(delivers[st.label])} GB/s "
              f"({gb(st.nic_bytes_per_s)} GB/s NIC, {st.read.describe()})")
    if not math.isnan(aic_wall):
        print(f"AIConfigurator {AIC_PIN.split('==')[1]}: {aic_wall:.0f} s wall")
    print()
    print("| planner: configuration | req/s | output tok/s/GPU | TTFT ms | storage read GB/s "
          "per reading node | x what a node's storage delivers | limit |")
    print("|---|---|---|---|---|---|---|")
    for k, c in aic.items():
        n = needs[k]
        share = ", ".join(f"{n.per_node_bytes_per_s / delivers[st.label]:.2f} {st.label}"
                          for st in stores)
        print(f"| AIConfigurator {k}: {c.layout} | {c.requests_per_s:.2f} | "
              f"{c.tokens_per_s_per_gpu:.1f} | {c.ttft_ms:.0f} (prefix free) | "
              f"{gb(n.per_node_bytes_per_s)} on {n.num_reading_nodes} of {num_nodes} nodes | "
              f"{share} | its SLO search, no storage |")
    for o in ours:
        print(f"| ours, same shape: {o.label} | {o.requests_per_s:.2f} | "
              f"{o.output_tokens_per_s_per_gpu:.1f} | {o.ttft_ms:.0f} | "
              f"{gb(o.read_bytes_per_s_per_node)} (busiest) | "
              f"{o.read_bytes_per_s_per_node / delivers[o.storage]:.2f} {o.storage} | "
              f"{o.limit} |")
    print(f"| `dualpath advise` ({args.trace} trajectories): {best.label}, {main_st.label} "
          f"storage | {a_turns:.2f} | {a_tokens:.1f} | {1e3 * ap_pt.ttft_s:.0f} | "
          f"{gb(a_read)} (busiest) | {a_read / delivers[main_st.label]:.2f} {main_st.label} | "
          f"{best.bottleneck} |")
    print()
    print(f"advise: {best.capacity_text} APS ({1e3 * best.aps_per_gpu:.2f} mAPS/GPU); its "
          f"turns: mean prompt {adv_res.col('prompt_tokens').mean():,.0f}, read from storage "
          f"{adv_res.col('hit_tokens').mean():,.0f}, generated "
          f"{adv_res.col('gen_tokens').mean():,.0f} tokens; runner-up: "
          + (f"{cands[1].label} {cands[1].capacity_text} APS" if len(cands) > 1 else "none"))
    print(f"wall: ours on AIConfigurator's shape {same_shape_s:.0f} s, advise {advise_s:.0f} s; "
          f"{ref_st.label} storage: the NIC rate and read model of that preset on "
          f"{args.hardware} nodes")
    if args.json:
        args.json.write_text(json.dumps({
            "date": date, "aic": {k: vars(c) for k, c in aic.items()},
            "storage_need": {k: {"read_bytes_per_s": n.read_bytes_per_s,
                                 "num_reading_nodes": n.num_reading_nodes}
                             for k, n in needs.items()},
            "deliver_bytes_per_s": delivers,
            "ours_same_shape": [vars(o) for o in ours],
            "advise": {"label": best.label, "capacity": best.capacity_text,
                       "turns_per_s": a_turns, "tokens_per_s_per_gpu": a_tokens,
                       "ttft_s": ap_pt.ttft_s, "read_bytes_per_s_per_node": a_read},
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
