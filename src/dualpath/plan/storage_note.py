"""The caveat a run gets when the packaged flat storage read rate meets Full Blocks far from the
size it was fitted on (`dualpath.reproduce.storage_fit` fits it; `advise`, `simulate` and
`analyze` print the note)."""

from __future__ import annotations

from dualpath.core.read_rate import parse_storage_read, storage_read_model
from dualpath.plan.runner import block_bytes
from dualpath.plan.setups import HARDWARE, setup

FIT_SETUP = "ds27b_1p1d"
"""The setup whose Full Blocks the packaged flat rate was fitted on (DS 27B 1P1D Basic)."""


def fit_block_bytes() -> float:
    """Bytes of one Full Block of the fitted setup's model (the only size the fit sees)."""
    return block_bytes(FIT_SETUP)


PAPER_IMPLIED_BLOCK_RATES: tuple[tuple[str, str, bool], ...] = (
    ("ds660b_2p4d", "at about the flat rate", True),
    ("qwen32b_1p2d", "at about 0.75 of the line rate", False),
)
"""What the paper's Basic JCTs imply its storage read for the other models' Full Blocks, and
whether that is the flat rate (the reproduction report's storage section)."""

FAR_BLOCK_RATIO = 2.0
"""Full Blocks this many times larger or smaller than the fitted one get a note."""


def block_size_note(block: float, nominal: float, hardware: str = HARDWARE) -> str:
    """A caveat for runs that read Full Blocks of `block` bytes at the packaged flat rate when
    they are far from the size it was fitted on: what the `queued` form (3FS#410's per-read
    cost) gives them and what the paper's other models imply. Empty when the hardware has no
    flat record, or the block is near the fitted one or one the paper read at the flat rate."""
    model = storage_read_model(hardware)
    fit = fit_block_bytes()
    if model.is_nominal or model.form != "flat" or 1 / FAR_BLOCK_RATIO < block / fit \
            < FAR_BLOCK_RATIO:
        return ""
    if any(is_flat and abs(block / block_bytes(name) - 1.0) < 0.1
           for name, _, is_flat in PAPER_IMPLIED_BLOCK_RATES):
        return ""  # the paper's own runs read blocks of this size at the flat rate
    queued = parse_storage_read("queued")
    assert queued is not None
    q = queued.read_bytes_per_s(nominal, block) / nominal
    paper = " and ".join(
        f"{setup(name).model}'s {block_bytes(name) / 1e6:.1f} MB blocks read {what}"
        for name, what, _ in PAPER_IMPLIED_BLOCK_RATES)
    return (f"note: the calibrated rate was fitted on {fit / 1e6:.2f} MB Full Blocks and is "
            f"applied to every size; these are {block / fit:.1f}x that. `--storage-read queued` "
            f"(3FS#410's per-read cost) reads them at {q:.3f} of the line rate; the paper's "
            f"Basic JCTs imply {paper} (docs/reproduction/README.md, storage section)")
