"""Unit constants. Bandwidths are bytes per second; sizes are bytes; times are seconds."""

from __future__ import annotations

KB = 1_000
MB = 1_000_000
GB = 1_000_000_000
TB = 1_000_000_000_000
KiB = 1024
MiB = 1024**2
GiB = 1024**3

TFLOPS = 1e12


def gbit_per_s(gbit: float) -> float:
    """Bytes per second of a link rated at `gbit` gigabits per second (400 Gb/s -> 50 GB/s)."""
    return gbit * 1e9 / 8


def fmt_bytes(n: float) -> str:
    """Human-readable decimal bytes: 1.5 GB, 640 KB."""
    for unit, scale in (("TB", TB), ("GB", GB), ("MB", MB), ("KB", KB)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_rate(n: float) -> str:
    """Human-readable bandwidth: 50 GB/s."""
    return f"{fmt_bytes(n)}/s"
