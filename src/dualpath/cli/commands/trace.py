"""`dualpath trace generate | stats | convert`: agent workloads and request traces.

generate  writes Table 2 synthetic trajectories (JSONL format v1, `workload.jsonl`) to --out
          (default: stdout), optionally scaled, truncated at a MAL and expanded to more agents;
          --fit MAXLEN,TURNS,APPEND,GEN,TOTAL,CONTEXT fits the generator to your own row.
stats     reads a trajectory file or a Mooncake trace (auto-detected; `-` is stdin) and prints
          Table 2's columns and the hit rate (or, for Mooncake, its request statistics and block
          reuse with an unbounded cache); --json for machine-readable output, --plot for a PNG.
convert   turns a Mooncake trace into trajectories where the trajectory model applies.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from tqdm import tqdm

from dualpath.core.blocks import DEFAULT_BLOCK_SIZE
from dualpath.core.errors import SpecError
from dualpath.core.validate import positive_int
from dualpath.workload.fit import fit_params
from dualpath.workload.jsonl import (
    EMPTY,
    TrajectoryFile,
    parse_trajectories,
    trajectory_file,
    write_trajectories,
)
from dualpath.workload.mooncake import MooncakeTrace, parse_mooncake, to_trajectories
from dualpath.workload.replay import expand_agents, scale_lengths
from dualpath.workload.stats import Table2Stats, table2_stats
from dualpath.workload.synthetic import PRESETS, TABLE2, Table2Row, generate, preset
from dualpath.workload.trace_errors import TraceFormatError
from dualpath.workload.trajectory import TurnTable


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "trace",
        help="generate, inspect and convert agent workloads (Table 2, Mooncake traces)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tsub = p.add_subparsers(dest="trace_command", metavar="<trace command>", required=True)

    g = tsub.add_parser("generate", help="synthetic Table 2 trajectories as JSONL")
    g.add_argument("--preset", default="64k",
                   help=f"MaxLen preset: {', '.join(PRESETS)} (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    g.add_argument("--num-trajectories", type=int, default=500, metavar="N",
                   help="trajectories to draw (default: %(default)s, as in the paper)")
    g.add_argument("--append-scale", type=float, default=1.0, metavar="X",
                   help="multiply every append length by X, then truncate at the MAL")
    g.add_argument("--gen-scale", type=float, default=1.0, metavar="X",
                   help="multiply every generation length by X, then truncate at the MAL")
    g.add_argument("--mal", type=int, metavar="TOKENS",
                   help="max agent length to truncate at (default: the preset's MaxLen)")
    g.add_argument("--num-agents", type=int, metavar="N",
                   help="expand to N agents (extra agents replay a sampled trajectory after a "
                        "synthetic round of 64 random tokens, as in the paper)")
    g.add_argument("--fit", metavar="MAXLEN,TURNS,APPEND,GEN,TOTAL,CONTEXT",
                   help="instead of --preset, fit the generator to your own Table 2 row "
                        "(about a minute; the fitted parameters go into the file's meta)")
    g.add_argument("--fit-iterations", type=int, default=400, metavar="N",
                   help="Nelder-Mead iterations for --fit (default: %(default)s)")
    g.add_argument("--out", default="-", metavar="PATH",
                   help="output file (default: stdout)")
    g.set_defaults(func=run_generate)

    s = tsub.add_parser("stats", help="Table 2 statistics and hit rate of a trace")
    s.add_argument("path", help="trajectory JSONL or Mooncake JSONL; - reads stdin")
    s.add_argument("--format", choices=("auto", "trajectories", "mooncake"), default="auto",
                   help="input format (default: detected from the first line)")
    s.add_argument("--block-size", type=int, metavar="TOKENS",
                   help="block size for trajectory hits (default: the file's, else 64)")
    s.add_argument("--compare", metavar="PRESET",
                   help="paper Table 2 row to compare with (default: the file's generator "
                        "preset or --fit target)")
    s.add_argument("--json", action="store_true", help="print the statistics as JSON")
    s.add_argument("--plot", metavar="PNG", help="write histograms to this PNG file")
    s.set_defaults(func=run_stats)

    c = tsub.add_parser("convert", help="Mooncake trace -> trajectory JSONL")
    c.add_argument("path", help="Mooncake JSONL; - reads stdin")
    c.add_argument("--out", default="-", metavar="PATH", help="output file (default: stdout)")
    c.set_defaults(func=run_convert)


def _open_out(path: str) -> TextIO:
    if path == "-":
        return sys.stdout
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as exc:
        raise TraceFormatError(path, 0, f"cannot write: {exc.strerror}") from None


def _display_name(path: str) -> str:
    return "<stdin>" if path == "-" else path


def _read_lines(path: str) -> list[str]:
    if path == "-":
        return sys.stdin.readlines()
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise TraceFormatError(path, 0, f"cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise TraceFormatError(path, 0, f"not UTF-8 text: {exc.reason}") from None


def _detect(lines: list[str], path: str) -> str:
    for raw in lines:
        if raw.strip():
            head = raw.lstrip()
            if '"format"' in head:
                return "trajectories"
            if '"hash_ids"' in head or '"input_length"' in head:
                return "mooncake"
            raise TraceFormatError(path, 1, "neither a trajectory header nor a Mooncake request;"
                                   " pass --format")
    raise TraceFormatError(path, 0, EMPTY)


def _fit_target(text: str) -> Table2Row:
    parts = text.split(",")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != 6 or min(values) <= 0 or not values[0].is_integer():
        raise SpecError("trace generate", "--fit", text,
                        "expected MAXLEN,TURNS,APPEND,GEN,TOTAL,CONTEXT, all positive, "
                        "MAXLEN an integer")
    if values[4] > values[0] or values[5] > values[0]:
        raise SpecError("trace generate", "--fit", text, "TOTAL and CONTEXT must be <= MAXLEN")
    return Table2Row(int(values[0]), *values[1:])


def run_generate(args: argparse.Namespace) -> int:
    if args.fit is not None:
        target = _fit_target(args.fit)
        positive_int("trace generate", "--fit-iterations", args.fit_iterations)
        with tqdm(total=args.fit_iterations, desc="fitting", unit="it", file=sys.stderr,
                  leave=False) as bar:

            def tick(best: float) -> None:
                bar.set_postfix(loss=f"{best:.2e}", refresh=False)
                bar.update()

            params = fit_params(target, num_trajectories=args.num_trajectories,
                                max_iter=args.fit_iterations, on_iteration=tick)
        name = f"fit-{target.max_len_tokens}"
    else:
        params = preset(args.preset).with_num_trajectories(args.num_trajectories)
        name = args.preset.lower()
    mal = args.mal if args.mal is not None else params.max_len_tokens
    trajs = generate(params, args.seed, id_prefix=f"{name}-{args.seed}-")
    if args.append_scale != 1.0 or args.gen_scale != 1.0 or mal != params.max_len_tokens:
        trajs = [scale_lengths(t, args.append_scale, args.gen_scale, mal) for t in trajs]
    mal_header = mal
    if args.num_agents is not None:
        trajs = [a.trajectory for a in expand_agents(trajs, args.num_agents, args.seed)]
        # A prepended synthetic round adds 65 tokens, so an expanded set may exceed the MAL.
        mal_header = max(mal, max(t.total_tokens for t in trajs))
    meta: dict[str, Any] = {
        "generator": "dualpath.workload.synthetic", "preset": name,
        "seed": args.seed, "params": params.to_dict(), "append_scale": args.append_scale,
        "gen_scale": args.gen_scale, "mal_tokens": mal, "num_agents": args.num_agents,
    }
    if args.fit is not None:
        meta["fit_target"] = asdict(target)
    tf = trajectory_file(trajs, mal_header, DEFAULT_BLOCK_SIZE, meta)
    out = _open_out(args.out)
    try:
        write_trajectories(out, tf)
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


def _pct(x: float) -> str:
    return f"{x:.1%}"


def render_table2(s: Table2Stats, compare: tuple[str, Table2Row] | None) -> str:
    """Table 2's columns for `s`, with a target row (label, row) and deviations if given."""
    head = f"{'':<10} {'Turns':>8} {'Append':>8} {'Gen':>8} {'Total':>9} {'Context':>9} {'Hit':>7}"
    ours = (s.turns, s.append_tokens, s.gen_tokens, s.total_tokens, s.context_tokens)
    lines = [
        f"{s.num_trajectories} trajectories, {s.num_turns} turns, hits in "
        f"{s.block_size_tokens}-token blocks",
        head,
        f"{'this file':<10} {ours[0]:>8.1f} {ours[1]:>8.0f} {ours[2]:>8.0f} {ours[3]:>9.0f} "
        f"{ours[4]:>9.0f} {_pct(s.paper_hit_rate):>7}",
    ]
    if compare is not None:
        label, row = compare
        paper = (row.turns, row.append_tokens, row.gen_tokens, row.total_tokens,
                 row.context_tokens)
        lines.append(
            f"{label:<10} {paper[0]:>8.0f} {paper[1]:>8.0f} "
            f"{paper[2]:>8.0f} {paper[3]:>9.0f} {paper[4]:>9.0f} {_pct(row.hit_rate):>7}"
        )
        devs = [o / p - 1 for o, p in zip(ours, paper, strict=True)]
        lines.append(
            f"{'deviation':<10} " + " ".join(
                f"{d:>+{w}.1%}" for d, w in zip(devs, (8, 8, 8, 9, 9), strict=True)
            ) + f" {(s.paper_hit_rate - row.hit_rate) * 100:>+6.2f}pt"
        )
    lines += [
        "",
        "Turns = mean turns per trajectory; Append, Gen = per-trajectory mean per turn,",
        "averaged; Total = mean final length; Context = mean context over all turns;",
        "Hit = 1 - Append/Context (the paper's formula).",
        f"Measured hit rate, all turns pooled (block-aligned hit tokens / prompt tokens): "
        f"{s.hit_rate:.2%}",
    ]
    return "\n".join(lines)


def render_mooncake(t: MooncakeTrace) -> str:
    """Request statistics and unbounded-cache reuse of a Mooncake trace."""
    ts = t.timestamp_s
    span = float(ts[-1] - ts[0]) if t.num_requests else 0.0
    return "\n".join([
        f"{t.num_requests} requests over {span:,.1f} s "
        f"({t.num_requests / span if span > 0 else float('nan'):.2f} req/s)",
        f"  input  tokens: mean {t.input_tokens.mean():,.0f}, "
        f"median {np.median(t.input_tokens):,.0f}, max {t.input_tokens.max():,}",
        f"  output tokens: mean {t.output_tokens.mean():,.0f}, "
        f"median {np.median(t.output_tokens):,.0f}, max {t.output_tokens.max():,}",
        f"  unbounded prefix cache ({t.block_size_tokens}-token blocks): block reuse "
        f"{t.block_reuse_rate:.1%} of {int(t.num_blocks.sum()):,} blocks; "
        f"token hit rate {t.token_hit_rate:.1%}",
    ])


def _mooncake_dict(t: MooncakeTrace) -> dict[str, Any]:
    return {
        "format": "mooncake",
        "num_requests": t.num_requests,
        "duration_s": float(t.timestamp_s[-1] - t.timestamp_s[0]),
        "mean_input_tokens": float(t.input_tokens.mean()),
        "mean_output_tokens": float(t.output_tokens.mean()),
        "num_blocks": int(t.num_blocks.sum()),
        "block_size_tokens": t.block_size_tokens,
        "block_reuse_rate": t.block_reuse_rate,
        "token_hit_rate": t.token_hit_rate,
    }


def _plot_trajectories(table: TurnTable, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = (
        (table.turns_per_trajectory, "turns per trajectory", False),
        (table.append_tokens, "append tokens per turn (log bins)", True),
        (table.gen_tokens, "generated tokens per turn", False),
        (table.context_tokens, "context tokens per turn", False),
    )
    for ax, (values, title, log) in zip(axes.flat, panels, strict=True):
        if log:
            bins = np.logspace(0, np.log10(max(2, int(values.max()))), 50)
            ax.set_xscale("log")
        else:
            bins = 50  # type: ignore[assignment]
        ax.hist(values, bins=bins)
        ax.set_title(title)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _plot_mooncake(t: MooncakeTrace, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    inp = t.input_tokens
    axes[0, 0].hist(inp, bins=np.logspace(np.log10(max(1, inp.min())), np.log10(inp.max()), 50))
    axes[0, 0].set_xscale("log")
    axes[0, 0].set_title("input tokens (log bins)")
    axes[0, 1].hist(t.output_tokens, bins=50)
    axes[0, 1].set_title("output tokens")
    axes[1, 0].hist(t.hit_tokens / inp, bins=50)
    axes[1, 0].set_title("hit fraction per request (unbounded cache)")
    axes[1, 1].hist(t.timestamp_s, bins=60)
    axes[1, 1].set_title("arrivals over time (s)")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _save(fig: Any, path: str) -> None:
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise TraceFormatError(path, 0, f"cannot write plot: {exc.strerror}") from None


def _compare_row(tf: TrajectoryFile, explicit: str | None) -> tuple[str, Table2Row] | None:
    """The row to compare with: --compare, else the file's preset, else its --fit target."""
    name = explicit.lower() if explicit is not None else tf.meta.get("preset")
    if explicit is not None and name not in TABLE2:
        preset(explicit)  # raises UnknownPresetError listing the valid names
    if isinstance(name, str) and name in TABLE2:
        return f"paper {name.upper()}", TABLE2[name]
    target = tf.meta.get("fit_target")
    if isinstance(target, dict):
        try:
            return "fit target", Table2Row(**target)
        except TypeError:
            return None
    return None


def run_stats(args: argparse.Namespace) -> int:
    lines = _read_lines(args.path)
    name = _display_name(args.path)
    fmt = args.format if args.format != "auto" else _detect(lines, name)
    if fmt == "mooncake":
        trace = parse_mooncake(lines, name)
        if args.plot:
            _plot_mooncake(trace, args.plot)
        print(json.dumps(_mooncake_dict(trace), indent=2) if args.json
              else render_mooncake(trace))
        return 0
    tf = parse_trajectories(lines, name)
    if not tf.trajectories:
        raise TraceFormatError(name, 0, "no trajectories")
    bs = args.block_size if args.block_size is not None else tf.block_size_tokens
    if isinstance(bs, int) and bs < 1:
        raise SpecError("trace stats", "--block-size", bs, "must be an integer >= 1")
    table = TurnTable.from_trajectories(tf.trajectories, bs)
    s = table2_stats(table)
    compare = _compare_row(tf, args.compare)
    if args.plot:
        _plot_trajectories(table, args.plot)
    if args.json:
        d: dict[str, Any] = {"format": "trajectories", **s.to_dict()}
        if compare is not None:
            label, row = compare
            d["compare"] = {"label": label, **asdict(row), "hit_rate": row.hit_rate}
        print(json.dumps(d, indent=2))
    else:
        print(render_table2(s, compare))
    return 0


def run_convert(args: argparse.Namespace) -> int:
    lines = _read_lines(args.path)
    trace = parse_mooncake(lines, _display_name(args.path))
    tf = to_trajectories(trace, source=args.path)
    buf = io.StringIO()
    write_trajectories(buf, tf)
    out = _open_out(args.out)
    try:
        out.write(buf.getvalue())
    finally:
        if out is not sys.stdout:
            out.close()
    n = len(tf.trajectories)
    print(f"converted {trace.num_requests} requests into {n} trajectories "
          f"({trace.num_requests - n} continuation turns)", file=sys.stderr)
    return 0

