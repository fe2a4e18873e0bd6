"""How fast a node's storage NIC moves KV reads: the storage system's effective rate, apart
from the NIC's nominal line rate, which the hardware preset keeps.

Three forms (docs/reproduction/README.md, "Storage read model"); a Full Block of `S` bytes on a
NIC of nominal rate `R`:

- `flat`: `rate = read_efficiency * R` for every block size.
- `per_block`: a fixed `per_block_overhead_s` per block that overlaps with nothing, bytes at
  `read_efficiency * R`: `rate(S) = S / (S / (read_efficiency * R) + per_block_overhead_s)`.
- `queued` (the paper's storage system, 3FS, as measured): each read costs a fixed latency `L`
  plus its bytes over one stream's rate `r`; a node keeps `C` reads in flight; the total is
  capped at `peak_fraction` of the line rate:

      rate(S) = min(peak_fraction * R, C * S / (L + S / r))

  `L`, `r` and the cap come from public 3FS measurements, not from the paper's cells
  (deepseek-ai/3FS#410: a client with one 400 Gb/s NIC, fio `hf3fs_usrbio`, random reads,
  32 jobs x iodepth 1, i.e. 32 reads in flight):

      1 MiB reads: 23.2 GiB/s  ->  t(1 MiB) = 32 x 1 MiB / 23.2 GiB/s = 1.347 ms
      4 MiB reads: 32.5 GiB/s  ->  t(4 MiB) = 32 x 4 MiB / 32.5 GiB/s = 3.846 ms
      r = (4 - 1) MiB / (3.846 - 1.347) ms = 1.259e9 B/s   (1.17 GiB/s per stream)
      L = 1.347 ms - 1 MiB / r             = 0.514 ms
      cap: ~42 GiB/s once tuned with 4x the reads in flight ("NIC bottleneck")
           = 42 / 46.57 GiB/s (400 Gb/s) = 0.90; the 3FS README's KVCache client peak,
           40 GiB/s on one 400 Gb/s NIC, is 0.86.

  Only `C` is left to fit (`dualpath.reproduce.storage_fit`); with `C` = 32 (3FS#410's own
  depth) the form reads 1 MiB at 0.50 and 4 MiB at 0.70 of the line rate, the two points.

Records per hardware preset live in the packaged `data/storage_calibration.json`, each with a
note on how it was fitted; a preset without one reads at its nominal rate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from dualpath.core.datafile import read_entries, write_text_atomic
from dualpath.core.errors import DualPathError
from dualpath.core.validate import non_negative, positive

STORAGE_FORMS = ("flat", "per_block", "queued")
"""The shapes a fit may take: `flat` fits `read_efficiency` (no overhead), `per_block` fits
`per_block_overhead_s` (efficiency 1), `queued` fits `reads_in_flight` (3FS's latency, stream
rate and cap fixed)."""

_MIB, _GIB = float(1 << 20), float(1 << 30)
_FIO_DEPTH = 32.0
_T_1MIB_S = _FIO_DEPTH * _MIB / (23.2 * _GIB)
_T_4MIB_S = _FIO_DEPTH * 4 * _MIB / (32.5 * _GIB)
THREEFS_STREAM_BYTES_PER_S = 3 * _MIB / (_T_4MIB_S - _T_1MIB_S)
"""One read stream's rate for a read's bytes, from 3FS#410's 1 MiB and 4 MiB points (32 in
flight): 1.259e9 B/s."""
THREEFS_READ_LATENCY_S = _T_1MIB_S - _MIB / THREEFS_STREAM_BYTES_PER_S
"""Fixed time of one read, the same two points' intercept: 0.514 ms."""
THREEFS_PEAK_FRACTION = 0.9
"""The most a 400 Gb/s client NIC delivered (3FS#410 after tuning, ~42 GiB/s of 46.57)."""


class StorageFileError(DualPathError, ValueError):
    """A malformed storage calibration file (names the file and the field)."""


@dataclass(frozen=True)
class StorageReadModel:
    """The effective KV read rate of one node's storage NIC. Writes run at the nominal rate
    (the fit cannot see them: persistence is a few percent of the bytes read)."""

    read_efficiency: float = 1.0
    """Fraction of the nominal rate the storage service delivers for a block's bytes."""
    per_block_overhead_s: float = 0.0
    """Seconds per Full Block read that overlap with nothing."""
    reads_in_flight: float = 0.0
    """`queued` form: Full Block reads a node keeps in flight (`C`); 0: another form."""
    read_latency_s: float = THREEFS_READ_LATENCY_S
    """`queued` form: fixed time of one read (`L`)."""
    stream_bytes_per_s: float = THREEFS_STREAM_BYTES_PER_S
    """`queued` form: one read's bytes move at this rate (`r`)."""
    peak_fraction: float = THREEFS_PEAK_FRACTION
    """`queued` form: cap on the total, as a fraction of the line rate."""
    source: str = "nominal: the storage NIC's line rate"

    def __post_init__(self) -> None:
        positive("storage", "read_efficiency", self.read_efficiency)
        if self.read_efficiency > 1.0:
            raise DualPathError(
                f"storage.read_efficiency={self.read_efficiency!r}: must be <= 1 (a fraction "
                "of the nominal rate)")
        non_negative("storage", "per_block_overhead_s", self.per_block_overhead_s)
        non_negative("storage", "reads_in_flight", self.reads_in_flight)
        non_negative("storage", "read_latency_s", self.read_latency_s)
        positive("storage", "stream_bytes_per_s", self.stream_bytes_per_s)
        positive("storage", "peak_fraction", self.peak_fraction)
        if self.peak_fraction > 1.0:
            raise DualPathError(
                f"storage.peak_fraction={self.peak_fraction!r}: must be <= 1 (a fraction of "
                "the nominal rate)")
        if self.reads_in_flight > 0 and (self.read_efficiency != 1.0
                                         or self.per_block_overhead_s != 0.0):
            raise DualPathError(
                f"storage.reads_in_flight={self.reads_in_flight!r}: the queued form takes no "
                "read_efficiency or per_block_overhead_s")

    @property
    def form(self) -> str:
        """`queued`, `per_block` or `flat` (which the nominal model is)."""
        if self.reads_in_flight > 0:
            return "queued"
        return "per_block" if self.per_block_overhead_s > 0 else "flat"

    @property
    def is_nominal(self) -> bool:
        return (self.read_efficiency == 1.0 and self.per_block_overhead_s == 0.0
                and self.reads_in_flight == 0.0)

    def describe(self) -> str:
        """The form and its numbers, in words."""
        if self.form == "queued":
            return (f"queued: {self.reads_in_flight:.1f} reads in flight, each "
                    f"{self.read_latency_s * 1e3:.3f} ms + bytes at "
                    f"{self.stream_bytes_per_s / 1e9:.3f} GB/s, capped at "
                    f"{self.peak_fraction:g} of the line rate")
        return (f"{self.form}: read efficiency {self.read_efficiency:.3f}, per-block overhead "
                f"{self.per_block_overhead_s * 1e6:.1f} us")

    def read_time_s(self, block_bytes: float) -> float:
        """`queued` form: one read's time `L + S / r`."""
        return self.read_latency_s + block_bytes / self.stream_bytes_per_s

    def read_bytes_per_s(self, nominal_bytes_per_s: float, block_bytes: float) -> float:
        """Sustained read rate for Full Blocks of `block_bytes` on a NIC of this nominal rate."""
        if self.reads_in_flight > 0:
            return min(self.peak_fraction * nominal_bytes_per_s,
                       self.reads_in_flight * block_bytes / self.read_time_s(block_bytes))
        rate = self.read_efficiency * nominal_bytes_per_s
        if self.per_block_overhead_s == 0.0:
            return rate  # exact: a nominal model leaves the line rate bit for bit
        return block_bytes / (block_bytes / rate + self.per_block_overhead_s)


NOMINAL = StorageReadModel()


THREEFS_READS_IN_FLIGHT = _FIO_DEPTH
"""The reads in flight of 3FS#410's measurement (32 jobs x iodepth 1): the `queued` form's
`C` when a user asks for it without one (the fit on DS 27B Basic gives 31.3)."""

STORAGE_READ_CHOICES = ("calibrated", "nominal", "flat:F", "queued", "queued:C")
"""What `parse_storage_read` takes (the CLI's `--storage-read`)."""


class StorageSpecError(DualPathError, ValueError):
    """A `--storage-read` value that names no read model (it quotes the value)."""


def parse_storage_read(text: str) -> StorageReadModel | None:
    """The read model `text` names; None for `calibrated` (the hardware preset's packaged
    record, `storage_read_model`). `nominal`: the line rate; `flat:F`: F of it for every
    block; `queued`: the 3FS form with 3FS#410's 32 reads in flight; `queued:C`: with C."""
    kind, sep, arg = text.strip().lower().partition(":")
    if kind in ("calibrated", "nominal") and not sep:
        return None if kind == "calibrated" else NOMINAL
    if kind not in ("flat", "queued") or (kind == "flat" and not sep):
        raise StorageSpecError(
            f"--storage-read {text!r}: expected one of {', '.join(STORAGE_READ_CHOICES)} "
            "(F a fraction of the line rate in (0, 1], C reads in flight > 0)")
    what = "F (a fraction of the line rate)" if kind == "flat" else "C (reads in flight)"
    try:
        value = float(arg) if sep else THREEFS_READS_IN_FLIGHT
    except ValueError:
        raise StorageSpecError(f"--storage-read {text!r}: {what} must be a number") from None
    try:
        if kind == "flat":
            return StorageReadModel(read_efficiency=value,
                                    source=f"--storage-read flat:{value:g}")
        if not 0.0 < value < float("inf"):
            raise DualPathError(f"{what} must be a positive number")
        return StorageReadModel(
            reads_in_flight=value,
            source=f"--storage-read queued:{value:g} (3FS#410's latency, stream rate, cap)")
    except DualPathError as exc:
        raise StorageSpecError(f"--storage-read {text!r}: {exc}") from None

def default_storage_file() -> Path:
    """The packaged `dualpath/data/storage_calibration.json`."""
    return Path(str(resources.files("dualpath").joinpath("data/storage_calibration.json")))


def _entries(path: Path) -> list[dict[str, Any]]:
    return read_entries(path, StorageFileError)


def storage_read_model(hardware: str, path: Path | None = None) -> StorageReadModel:
    """The calibrated read model of the named hardware preset, else `NOMINAL`. A preset
    derived from another (named `base+what changed`, as the CLI's and the experiments'
    overrides name theirs) keeps its base's storage system."""
    p = path or default_storage_file()
    base = hardware.split("+", 1)[0]
    for i, e in enumerate(_entries(p)):
        if e.get("hardware") != base:
            continue
        values: dict[str, float] = {}
        for name, default in _NUMBERS:
            v = e.get(name, default)
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise StorageFileError(f"{p}: entry {i} ({base}): {name}={v!r}: must be a "
                                       "number")
            values[name] = float(v)
        try:
            return StorageReadModel(**values, source=str(e.get("source", "")))
        except DualPathError as exc:
            raise StorageFileError(f"{p}: entry {i} ({base}): {exc}") from None
    return NOMINAL


_NUMBERS: tuple[tuple[str, float], ...] = (
    ("read_efficiency", 1.0), ("per_block_overhead_s", 0.0), ("reads_in_flight", 0.0),
    ("read_latency_s", THREEFS_READ_LATENCY_S),
    ("stream_bytes_per_s", THREEFS_STREAM_BYTES_PER_S),
    ("peak_fraction", THREEFS_PEAK_FRACTION))
"""A record's numbers and their defaults (a record of another form need not name the
`queued` form's constants)."""


def write_storage_record(hardware: str, model: StorageReadModel, extra: dict[str, object],
                         path: Path | None = None) -> Path:
    """Store `model` as the record of `hardware` (replacing an earlier one), with `extra`
    fields (the fit's form, cells and residuals) beside it."""
    p = path or default_storage_file()
    entries = [e for e in _entries(p) if e.get("hardware") != hardware] if p.exists() else []
    numbers: dict[str, float] = {
        "read_efficiency": round(model.read_efficiency, 4),
        "per_block_overhead_s": float(f"{model.per_block_overhead_s:.4g}")}
    if model.form == "queued":
        numbers = {"reads_in_flight": round(model.reads_in_flight, 2),
                   "read_latency_s": float(f"{model.read_latency_s:.4g}"),
                   "stream_bytes_per_s": float(f"{model.stream_bytes_per_s:.4g}"),
                   "peak_fraction": model.peak_fraction}
    entries.append({"hardware": hardware, **numbers, "source": model.source, **extra})
    doc = {"about": ABOUT, "entries": sorted(entries, key=lambda e: str(e["hardware"]))}
    write_text_atomic(p, json.dumps(doc, indent=2) + "\n")
    return p


ABOUT = ("Effective storage read model per hardware preset (dualpath.core.read_rate), for "
         "Full Blocks of S bytes: rate(S) = S / (S / (read_efficiency * nominal) + "
         "per_block_overhead_s) (flat, per_block); or, with reads_in_flight C > 0 (queued), "
         "min(peak_fraction * nominal, C * S / (read_latency_s + S / stream_bytes_per_s)). "
         "Written by `dualpath reproduce calibrate-storage --write`; a preset without an "
         "entry reads at its nominal rate.")
