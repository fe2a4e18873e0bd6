"""How fast a node's storage NIC moves KV reads: the storage system's effective rate, apart
from the NIC's nominal line rate, which the hardware preset keeps.

One small physical model covers the candidates the reproduction weighs (docs/reproduction.md,
"Storage read model"): a Full Block of `S` bytes costs a fixed `per_block_overhead_s` (request
handling that pipelining does not hide) plus its bytes at `read_efficiency` of the nominal rate
`R` (the storage service's throughput per client node), so the sustained rate is

    rate(S) = S / (S / (read_efficiency * R) + per_block_overhead_s)

With no overhead the rate is a flat fraction of `R`, whatever the block size; with efficiency 1
and an overhead, large blocks approach `R` and small ones lose most of it. Records per hardware
preset live in the packaged `data/storage_calibration.json`, each with a note on how it was
fitted; a preset without one reads at its nominal rate.
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

STORAGE_FORMS = ("flat", "per_block")
"""The two shapes a fit may take: `flat` fits `read_efficiency` (no overhead), `per_block`
fits `per_block_overhead_s` (efficiency 1)."""


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
    source: str = "nominal: the storage NIC's line rate"

    def __post_init__(self) -> None:
        positive("storage", "read_efficiency", self.read_efficiency)
        if self.read_efficiency > 1.0:
            raise DualPathError(
                f"storage.read_efficiency={self.read_efficiency!r}: must be <= 1 (a fraction "
                "of the nominal rate)")
        non_negative("storage", "per_block_overhead_s", self.per_block_overhead_s)

    @property
    def is_nominal(self) -> bool:
        return self.read_efficiency == 1.0 and self.per_block_overhead_s == 0.0

    def read_bytes_per_s(self, nominal_bytes_per_s: float, block_bytes: float) -> float:
        """Sustained read rate for Full Blocks of `block_bytes` on a NIC of this nominal rate."""
        rate = self.read_efficiency * nominal_bytes_per_s
        if self.per_block_overhead_s == 0.0:
            return rate  # exact: a nominal model leaves the line rate bit for bit
        return block_bytes / (block_bytes / rate + self.per_block_overhead_s)


NOMINAL = StorageReadModel()


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
        for name, default in (("read_efficiency", 1.0), ("per_block_overhead_s", 0.0)):
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


def write_storage_record(hardware: str, model: StorageReadModel, extra: dict[str, object],
                         path: Path | None = None) -> Path:
    """Store `model` as the record of `hardware` (replacing an earlier one), with `extra`
    fields (the fit's form, cells and residuals) beside it."""
    p = path or default_storage_file()
    entries = [e for e in _entries(p) if e.get("hardware") != hardware] if p.exists() else []
    entries.append({"hardware": hardware, "read_efficiency": round(model.read_efficiency, 4),
                    "per_block_overhead_s": float(f"{model.per_block_overhead_s:.4g}"),
                    "source": model.source, **extra})
    doc = {"about": ABOUT, "entries": sorted(entries, key=lambda e: str(e["hardware"]))}
    write_text_atomic(p, json.dumps(doc, indent=2) + "\n")
    return p


ABOUT = ("Effective storage read model per hardware preset (dualpath.core.storage): "
         "rate(S) = S / (S / (read_efficiency * nominal) + per_block_overhead_s) for Full "
         "Blocks of S bytes. Written by `dualpath reproduce calibrate-storage --write`; a "
         "preset without an entry reads at its nominal rate.")
