"""Profile files: one engine's measured step costs, versioned JSON (`dualpath profile` writes
them; `dualpath simulate --profile` and `dualpath advise --profile` read them).

A file holds what was measured (raw timings), the fit of `dualpath.sched.profiled.ProfiledCosts`
to them, the model's shape, the machine and the date, and the run configuration of the cluster
the engine runs in (emulated NIC rates, engines per node, engine memory, block size, the
scheduler's quota and beta), so a simulation of that cluster needs nothing else:

    {"format": "dualpath-profile", "version": 1, "created": "...Z",
     "machine": {...}, "engine": {"kind": "dualpath-runtime", ...},
     "model": {"name", "num_layers", "hidden_size", ..., "kv_bytes_per_token"},
     "run": {"storage_nic_bytes_per_s", "compute_nic_bytes_per_s", "engines_per_node",
             "hbm_bytes", "dram_buffer_bytes", "block_size", "compute_quota_s", "beta_tokens",
             "storage_reads": {"pe": {"discipline", "max_in_flight"}, "de": {...}, "why"},
             "control_plane": {"dispatch_s", "return_s", "why"}},
     "measured": {"prefill": [{"cached", "new", "batch", "seconds"}, ...],
                  "decode": [{"batch", "context", "seconds"}, ...],
                  "turns": [{"prompt", "hit", "gen", "first_token_s", "next_submit_s",
                             "prefill_s", "decode_s"}, ...],
                  "rates": {"memory_copy", "store_write", "store_read"}},
     "fit": {"prefill_fixed_s", ..., "per_context_token_s",
             "prefill_median_error", "decode_median_error"}}

`run.storage_reads` (optional; absent: `fifo` on both sides) says how the engine's reader
serves the requests whose hits a node's storage NIC reads (`dualpath.sim.ReadDiscipline`): the
PE side's reads on a prefill node, the DE side's on a decode node. It comes from how the
engine issues its reads, never from a compared run.

`run.control_plane` (optional; absent: none) is the per-turn latency of the deployment's
control plane, which no step cost holds: `dispatch_s` from a turn's submission until the
engines have it, beyond the prefill pass (the simulator delays the scheduler's submit by it),
and `return_s` from a turn's first token until the client has submitted the agent's next turn,
beyond the decode steps (the simulator delays the next turn's arrival by it). `dualpath
profile` measures both on the engine's own process path with unpaced I/O, one turn at a time
(`measured.turns`: each turn's first token and the next submission, seconds after its own
submission, and the fitted prefill and decode times subtracted from them; the medians are the
terms).

A bad file is one line naming the file and the field (`ProfileFileError`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from dualpath.core.cluster import ClusterSpec
from dualpath.core.errors import DualPathError, SpecError
from dualpath.core.hardware import HardwareSpec, hardware_preset
from dualpath.core.model import ModelSpec, dense_gqa_spec
from dualpath.core.read_rate import NOMINAL
from dualpath.sched.params import SchedulerParams, alpha_tokens_of
from dualpath.sched.profiled import ProfiledCosts
from dualpath.sim.config import FIFO, ReadDiscipline, SimParams

FORMAT = "dualpath-profile"
VERSION = 1
ENGINE_KINDS = ("dualpath-runtime", "vllm")

_MODEL_INT = ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "vocab_size", "kv_dtype_bytes", "weight_dtype_bytes",
              "kv_bytes_per_token")
_RUN_NUM = ("storage_nic_bytes_per_s", "compute_nic_bytes_per_s", "engines_per_node",
            "hbm_bytes", "dram_buffer_bytes", "block_size", "compute_quota_s", "beta_tokens")
_RUN_INT = ("engines_per_node", "hbm_bytes", "dram_buffer_bytes", "block_size")
_COST_FIELDS = tuple(f.name for f in fields(ProfiledCosts) if f.name != "source")
TURN_KEYS = ("prompt", "hit", "gen", "first_token_s", "next_submit_s", "prefill_s", "decode_s")
"""A `measured.turns` row: one turn timed through the engine's process path (see
`control_plane_terms`)."""


Arr = npt.NDArray[np.float64]


class ProfileFileError(DualPathError, ValueError):
    """A profile file that cannot be read or holds a bad field."""


# -- fitting -------------------------------------------------------------------------------

def _nonneg_fit(columns: list[Arr], t: Arr) -> list[float]:
    """Least squares of `t` on `columns` in relative terms (each row weighted by 1/t), every
    coefficient >= 0: a negative one is dropped and the rest refit."""
    w = 1.0 / np.maximum(t, 1e-12)
    keep = list(range(len(columns)))
    coef = [0.0] * len(columns)
    while keep:
        a = np.stack([columns[i] * w for i in keep], axis=1)
        sol, *_ = np.linalg.lstsq(a, t * w, rcond=None)
        if (sol >= 0).all():
            for i, v in zip(keep, sol, strict=True):
                coef[i] = float(v)
            break
        keep.pop(int(np.argmin(sol)))
    return coef


def _predict(coef: list[float], columns: list[Arr]) -> Arr:
    out: Arr = np.stack(columns, axis=1) @ np.asarray(coef, dtype=np.float64)
    return out


def _median_error(pred: Arr, t: Arr) -> float:
    return float(np.median(np.abs(pred - t) / np.maximum(t, 1e-12)))


def fit_costs(prefill: Sequence[dict[str, float]], decode: Sequence[dict[str, float]],
              source: str = "") -> tuple[ProfiledCosts, float, float]:
    """`ProfiledCosts` fitted to the samples, with the median relative error of each fit.

    A prefill sample is one pass of `batch` sequences of (`cached`, `new`) tokens; a decode
    sample one step of `batch` sequences of `context` tokens each."""
    if len(prefill) < 4:
        raise ProfileFileError(f"measured.prefill: {len(prefill)} samples, need at least 4")
    if len(decode) < 3:
        raise ProfileFileError(f"measured.decode: {len(decode)} samples, need at least 3")
    c = np.array([s["cached"] for s in prefill], dtype=np.float64)
    n = np.array([s["new"] for s in prefill], dtype=np.float64)
    b = np.array([s["batch"] for s in prefill], dtype=np.float64)
    t = np.array([s["seconds"] for s in prefill], dtype=np.float64)
    cols = [np.ones_like(t), b, b * n, b * n * (c + n), b * c]
    pf = _nonneg_fit(cols, t)
    p_err = _median_error(_predict(pf, cols), t)
    db = np.array([s["batch"] for s in decode], dtype=np.float64)
    ctx = np.array([s["context"] for s in decode], dtype=np.float64)
    dt = np.array([s["seconds"] for s in decode], dtype=np.float64)
    dcols = [np.ones_like(dt), db, db * ctx]
    df = _nonneg_fit(dcols, dt)
    d_err = _median_error(_predict(df, dcols), dt)
    costs = ProfiledCosts(
        prefill_fixed_s=pf[0], per_prefill_seq_s=pf[1], per_new_token_s=pf[2],
        per_query_key_s=pf[3], per_cached_token_s=pf[4],
        decode_fixed_s=df[0], per_seq_s=df[1], per_context_token_s=df[2], source=source)
    return costs, p_err, d_err


# -- the file ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Profile:
    """A read (validated) profile file."""

    path: str
    data: dict[str, Any]
    costs: ProfiledCosts

    @property
    def model(self) -> dict[str, Any]:
        return dict(self.data["model"])

    @property
    def run(self) -> dict[str, Any]:
        return dict(self.data["run"])

    def model_spec(self) -> ModelSpec:
        """The profiled model as the simulator's `ModelSpec` (a dense Llama-family model)."""
        m = self.data["model"]
        return dense_gqa_spec(
            str(m["name"]), hidden=m["hidden_size"], num_layers=m["num_layers"],
            num_heads=m["num_attention_heads"], num_kv_heads=m["num_kv_heads"],
            head_dim=m["head_dim"], intermediate=m["intermediate_size"],
            vocab_size=m["vocab_size"], kv_dtype_bytes=m["kv_dtype_bytes"],
            weight_dtype_bytes=m["weight_dtype_bytes"],
            is_tied_embeddings=bool(m.get("is_tied_embeddings", False)),
            source=f"profile {self.path}",
        )

    def hardware(self, base: str = "cpu-emulated") -> HardwareSpec:
        """The `base` preset with the run's NIC rates, engines per node, DRAM buffer, and an
        HBM that leaves exactly the run's engine memory for KV once the weights are in."""
        r, spec = self.data["run"], self.model_spec()
        return replace(
            hardware_preset(base),
            name=f"{base}@profile",
            gpus_per_node=int(r["engines_per_node"]),
            storage_nic_bytes_per_s=float(r["storage_nic_bytes_per_s"]),
            compute_nic_bytes_per_s=float(r["compute_nic_bytes_per_s"]),
            dram_buffer_bytes=int(r["dram_buffer_bytes"]),
            hbm_bytes=int(r["hbm_bytes"] + spec.weight_bytes),
        )

    def cluster(self, num_prefill_nodes: int, num_decode_nodes: int) -> ClusterSpec:
        return ClusterSpec(self.hardware(), self.model_spec(), num_prefill_nodes,
                           num_decode_nodes)

    def scheduler_params(self) -> SchedulerParams:
        """The run's scheduler constants: alpha 3 s of one storage NIC's reads, its beta and
        compute quota."""
        r = self.data["run"]
        kv = int(self.data["model"]["kv_bytes_per_token"])
        return SchedulerParams(
            alpha_tokens=alpha_tokens_of(float(r["storage_nic_bytes_per_s"]), kv),
            beta_tokens=float(r["beta_tokens"]),
            kv_bytes_per_token=kv,
            block_size_tokens=int(r["block_size"]),
            compute_quota_s=float(r["compute_quota_s"]),
        )

    def read_disciplines(self) -> tuple[ReadDiscipline, ReadDiscipline]:
        """How the engine's reader serves a prefill node's and a decode node's storage NIC
        (`run.storage_reads`; absent: `fifo`, the paper's read queue, on both)."""
        reads = self.data["run"].get("storage_reads")
        if reads is None:
            return FIFO, FIFO
        return _discipline(self.path, reads, "pe"), _discipline(self.path, reads, "de")

    def control_plane(self) -> tuple[float, float]:
        """`(dispatch_s, return_s)` of `run.control_plane`; absent: `(0, 0)`."""
        cp = self.data["run"].get("control_plane")
        if cp is None:
            return 0.0, 0.0
        return float(cp["dispatch_s"]), float(cp["return_s"])

    def sim_kwargs(self) -> dict[str, Any]:
        """`SimConfig` fields that make a simulation run this profile's cluster: the measured
        costs, the run's scheduler constants, its block size, no HBM reserve (the engine
        memory is already what is left for KV), storage read at the line rate (the runtime
        paces its storage NICs at exactly that rate) with the engine's read disciplines, and
        an agent's next turn only once the last one is persisted (the runtime reports a turn
        done after persisting its blocks), and the control plane's per-turn latencies."""
        r = self.data["run"]
        pe_reads, de_reads = self.read_disciplines()
        dispatch_s, return_s = self.control_plane()
        return {
            "step_costs": self.costs,
            "scheduler": self.scheduler_params(),
            "params": SimParams(block_size_tokens=int(r["block_size"]), hbm_reserve_fraction=0.0,
                                storage_read=NOMINAL, is_next_turn_after_persist=True,
                                pe_reads=pe_reads, de_reads=de_reads,
                                turn_dispatch_s=dispatch_s, turn_return_s=return_s),
        }

    def describe(self) -> str:
        c, m, e = self.costs, self.data["model"], self.data["engine"]
        dispatch_s, return_s = self.control_plane()
        cp = (f"; control plane {dispatch_s * 1e3:.1f} ms in + {return_s * 1e3:.1f} ms out a "
              "turn" if "control_plane" in self.data["run"] else "")
        return (f"{e['kind']} {m['name']} on {self.data['machine'].get('hostname', '?')} "
                f"({self.data['created']}): prefill {c.prefill_fixed_s * 1e3:.2f} ms + "
                f"{c.per_prefill_seq_s * 1e6:.0f} us/seq + "
                f"{c.per_new_token_s * 1e6:.2f} us/new token + "
                f"{c.per_query_key_s * 1e9:.3f} ns/(query,key) + "
                f"{c.per_cached_token_s * 1e6:.3f} us/cached token; decode "
                f"{c.decode_fixed_s * 1e3:.2f} ms + {c.per_seq_s * 1e6:.1f} us/seq + "
                f"{c.per_context_token_s * 1e9:.2f} ns/context token{cp}")


def _need(path: str, obj: Any, where: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(obj, kind) or isinstance(obj, bool):
        name = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ProfileFileError(f"{path}: field {where!r}: must be a {name}, got {obj!r}")
    return obj


def _discipline(path: str, reads: Any, side: str) -> ReadDiscipline:
    """`run.storage_reads.<side>` as a `ReadDiscipline`; a bad one names the field."""
    where = f"run.storage_reads.{side}"
    entry = _need(path, _need(path, reads, "run.storage_reads", dict).get(side), where, dict)
    kind = _need(path, entry.get("discipline"), f"{where}.discipline", str)
    limit = int(_number(path, entry, where, "max_in_flight", integer=True)) \
        if "max_in_flight" in entry else 0
    try:
        return ReadDiscipline(kind, limit)
    except SpecError as exc:
        raise ProfileFileError(f"{path}: field {where!r}: {exc}") from None


def _number(path: str, obj: dict[str, Any], section: str, name: str, *,
            integer: bool = False, positive: bool = False) -> float:
    where = f"{section}.{name}"
    if name not in obj:
        raise ProfileFileError(f"{path}: field {where!r}: missing")
    v = _need(path, obj[name], where, int if integer else (int, float))
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ProfileFileError(f"{path}: field {where!r}: must be a finite number "
                               f"{'> 0' if positive else '>= 0'}, got {v!r}")
    return float(v)


def parse_profile(data: Any, path: str = "<profile>") -> Profile:
    """Validate a profile's JSON object; errors name the file and the field."""
    _need(path, data, "(top level)", dict)
    if data.get("format") != FORMAT:
        raise ProfileFileError(f"{path}: field 'format': must be {FORMAT!r}, got "
                               f"{data.get('format')!r}")
    version = data.get("version")
    if version != VERSION:
        raise ProfileFileError(f"{path}: field 'version': {version!r} is not supported "
                               f"(this dualpath reads version {VERSION})")
    _need(path, data.get("created"), "created", str)
    for section in ("machine", "engine", "model", "run", "measured", "fit"):
        _need(path, data.get(section), section, dict)
    kind = data["engine"].get("kind")
    if kind not in ENGINE_KINDS:
        raise ProfileFileError(f"{path}: field 'engine.kind': must be one of "
                               f"{', '.join(ENGINE_KINDS)}, got {kind!r}")
    _need(path, data["model"].get("name"), "model.name", str)
    for name in _MODEL_INT:
        _number(path, data["model"], "model", name, integer=True, positive=True)
    for name in _RUN_NUM:
        _number(path, data["run"], "run", name, integer=name in _RUN_INT, positive=True)
    if "storage_reads" in data["run"]:
        for side in ("pe", "de"):
            _discipline(path, data["run"]["storage_reads"], side)
    if "control_plane" in data["run"]:
        cp = _need(path, data["run"]["control_plane"], "run.control_plane", dict)
        for name in ("dispatch_s", "return_s"):
            _number(path, cp, "run.control_plane", name)
    meas = data["measured"]
    for name, keys in (("prefill", ("cached", "new", "batch", "seconds")),
                       ("decode", ("batch", "context", "seconds")),
                       ("turns", TURN_KEYS)):
        if name == "turns" and name not in meas:
            continue
        rows = _need(path, meas.get(name), f"measured.{name}", list)
        for i, row in enumerate(rows):
            _need(path, row, f"measured.{name}[{i}]", dict)
            for key in keys:
                _number(path, row, f"measured.{name}[{i}]", key, positive=key == "seconds")
    for name in _COST_FIELDS:
        _number(path, data["fit"], "fit", name)
    fit = data["fit"]
    costs = ProfiledCosts(**{n: float(fit[n]) for n in _COST_FIELDS},
                          source=f"profile {path}")
    return Profile(path, data, costs)


def load_profile(path: str | Path) -> Profile:
    """Read and validate the profile file at `path`."""
    p = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileFileError(f"{p}: cannot read: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileFileError(f"{p}:{exc.lineno}: not JSON: {exc.msg}") from None
    return parse_profile(data, p)


def control_plane_terms(costs: ProfiledCosts, turns: Sequence[dict[str, float]]
                        ) -> tuple[list[dict[str, float]], float, float]:
    """The control plane's per-turn latencies from turns timed one at a time with unpaced I/O.

    A turn row holds its `prompt`, `hit` and `gen` tokens, and, in seconds after its own
    submission, when its first token came (`first_token_s`) and when the agent's next turn was
    submitted (`next_submit_s`). The fitted costs of its work are taken off: one prefill pass
    of (`hit`, `prompt - hit`) from the first token, and `gen - 1` decode steps of one sequence
    (at `prompt + gen / 2` tokens of context, as the simulator charges them) from the rest.
    Returns the rows with those times added (`prefill_s`, `decode_s`), and the medians of
    what is left: `(dispatch_s, return_s)`, each at least 0."""
    if not turns:
        raise ProfileFileError("measured.turns: no turns")
    rows, dispatch, back = [], [], []
    for t in turns:
        prompt, hit, gen = float(t["prompt"]), float(t["hit"]), float(t["gen"])
        prefill_s = costs.prefill_pass_time_s([(hit, prompt - hit)])
        decode_s = max(0.0, gen - 1) * costs.decode_step_time_s(1, prompt + gen / 2.0)
        rows.append({**t, "prefill_s": prefill_s, "decode_s": decode_s})
        dispatch.append(float(t["first_token_s"]) - prefill_s)
        back.append(float(t["next_submit_s"]) - float(t["first_token_s"]) - decode_s)
    return (rows, max(0.0, float(np.median(dispatch))), max(0.0, float(np.median(back))))


def build_profile(*, created: str, machine: dict[str, Any], engine: dict[str, Any],
                  model: dict[str, Any], run: dict[str, Any],
                  prefill: Sequence[dict[str, float]], decode: Sequence[dict[str, float]],
                  rates: dict[str, float],
                  turns: Sequence[dict[str, float]] | None = None,
                  turns_how: str = "") -> dict[str, Any]:
    """A profile's JSON object from its measurements (fitted here), validated. `turns`
    (optional): turns timed through the engine's process path, from which
    `run.control_plane` is derived (`control_plane_terms`; `turns_how` says how they ran)."""
    costs, p_err, d_err = fit_costs(prefill, decode)
    fit = {n: getattr(costs, n) for n in _COST_FIELDS}
    fit.update(prefill_median_error=p_err, decode_median_error=d_err)
    measured: dict[str, Any] = {"prefill": list(prefill), "decode": list(decode)}
    if turns is not None:
        rows, dispatch_s, return_s = control_plane_terms(costs, turns)
        run = {**run, "control_plane": {"dispatch_s": dispatch_s, "return_s": return_s,
                                        "why": turns_how}}
        measured["turns"] = rows
    measured["rates"] = rates
    data = {
        "format": FORMAT, "version": VERSION, "created": created, "machine": machine,
        "engine": engine, "model": model, "run": run, "measured": measured, "fit": fit,
    }
    parse_profile(data)
    return data


def write_profile(path: str | Path, data: dict[str, Any]) -> None:
    """Write `data` as indented JSON (one sample per line, so a file diffs well)."""
    meas = data["measured"]
    head = {k: v for k, v in data.items() if k != "measured"}
    body = json.dumps(head, indent=1)[:-2]
    rows = ",\n".join(
        f'  "{name}": [\n' + ",\n".join("   " + json.dumps(r) for r in meas[name]) + "\n  ]"
        for name in ("prefill", "decode", "turns") if name in meas)
    text = (body + ',\n "measured": {\n' + rows + ',\n  "rates": '
            + json.dumps(meas["rates"]) + "\n }\n}\n")
    json.loads(text)  # the hand-joined layout must stay JSON
    Path(path).write_text(text, encoding="utf-8")
