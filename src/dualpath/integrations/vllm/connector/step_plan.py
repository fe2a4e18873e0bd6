"""What the scheduler side hands the workers each step (`StepPlan`, inside vLLM's connector
metadata): the blocks of each request to load, save, pull and push, in vLLM block terms; and
what both sides agree on: store files of `blocks_per_file` blocks (`plan`'s "Files"), the
background loads' threads. Pure: no vllm, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from dualpath.core.errors import SpecError


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request to move between storage and vLLM's paged KV in one step."""

    req_id: str
    first_block: int
    """Index (in the request) of the first block; blocks are consecutive."""
    block_ids: tuple[int, ...]
    """vLLM's physical block ids, one per block."""
    keys: tuple[bytes, ...]
    """Storage keys, one per file holding any of the blocks (file `i`: the request's blocks
    `[i * g, (i + 1) * g)`, under its last block's key), from file `first_block // g` on."""
    blocks_per_file: int = 1
    """g: vLLM blocks per store file."""

    def __post_init__(self) -> None:
        g = self.blocks_per_file
        if g < 1:
            raise SpecError("vllm connector", "blocks_per_file", g, "must be an integer >= 1")
        n = len(self.block_ids)
        num_files = (self.first_block + n - 1) // g - self.first_block // g + 1 if n else 0
        if len(self.keys) != num_files:
            raise ValueError(f"{self.req_id}: {n} block ids from block {self.first_block} "
                             f"are in {num_files} files of {g} blocks, got {len(self.keys)} "
                             "keys")

    @property
    def is_aligned(self) -> bool:
        """Whole files only: the transfer starts and ends at a file's edge."""
        g = self.blocks_per_file
        return self.first_block % g == 0 and len(self.block_ids) % g == 0

    def files(self) -> list[tuple[bytes, list[int | None]]]:
        """Each file's key and, for each of its g blocks in order, the block's index in
        `block_ids` (None: a block of the file outside this transfer, read and dropped)."""
        g, n = self.blocks_per_file, len(self.block_ids)
        out: list[tuple[bytes, list[int | None]]] = []
        for f, key in enumerate(self.keys, self.first_block // g):
            rows = [b - self.first_block for b in range(f * g, (f + 1) * g)]
            out.append((key, [r if 0 <= r < n else None for r in rows]))
        return out


@dataclass(frozen=True)
class RemoteLoad:
    """Prefill: DE-side hit blocks, read by the decode instance, pulled from its buffer."""

    xfer: str
    de: str
    blocks: BlockTransfer


@dataclass(frozen=True)
class Push:
    """Prefill: the blocks the decode instance lacks, written into its buffer after prefill."""

    xfer: str
    de: str
    req_id: str
    block_indices: tuple[int, ...]
    """The prompt's blocks to push (an index into `block_ids`)."""
    block_ids: tuple[int, ...]
    """vLLM block ids of all the prompt's blocks."""
    hit_blocks: int
    """The end of the blocks the decode instance staged itself (its DE-side load, those of
    `[0, hit_blocks)` not in `block_indices`); the worker adds them from a failed load's
    first block on (the decode instance then lacks them too)."""


@dataclass(frozen=True)
class XferLoad:
    """Decode: blocks `first_block ..` of the request from the staging buffer under `xfer`."""

    xfer: str
    req_id: str
    first_block: int
    block_ids: tuple[int, ...]


FILE_TOKENS = 128
"""What a store file covers by default: `default_blocks_per_file`."""


def default_blocks_per_file(block_size: int) -> int:
    """g when `blocks_per_file` is not set: files of at least `FILE_TOKENS` tokens where the
    blocks are smaller (vLLM's 16-token blocks: 8 a file), else a block a file."""
    return max(1, FILE_TOKENS // max(1, block_size))


def check_blocks_per_file(value: object) -> int:
    """`kv_connector_extra_config.blocks_per_file` as an int >= 1, else a `SpecError`."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise SpecError("vllm connector", "blocks_per_file", value, "must be an integer >= 1")
    try:
        g = int(value)
    except ValueError:
        raise SpecError("vllm connector", "blocks_per_file", value,
                        "must be an integer >= 1") from None
    if g < 1:
        raise SpecError("vllm connector", "blocks_per_file", value, "must be an integer >= 1")
    return g


BACKGROUND_LOAD_THREADS = 4
"""Threads of a prefill worker's background loads per read path (`async_loader.AsyncLoader`):
each reads one request's blocks one after another, so this many requests share the path's NIC."""


def storage_read_disciplines(async_loads: bool) -> dict[str, object]:
    """How this connector's reads serve the requests whose hits a node's storage NIC reads, as
    a profile's `run.storage_reads` (`dualpath.sim.ReadDiscipline`'s kinds).

    PE side: background loads (`async_loads`) give each of up to `BACKGROUND_LOAD_THREADS`
    requests a thread that reads its blocks one at a time, so their blocks take turns on the
    NIC (`shared`); in-step loads hand every block of the step to one pool in request order
    (`fifo`). DE side: the decode node's side channel hands a stage's blocks to one pool of
    the node, all at once, in the order the stages arrive (`fifo`)."""
    pe: dict[str, object] = ({"discipline": "shared", "max_in_flight": BACKGROUND_LOAD_THREADS}
                             if async_loads else {"discipline": "fifo"})
    return {
        "pe": pe, "de": {"discipline": "fifo"},
        "why": ("PE: " + ("background loads, a thread per request reading its blocks in turn "
                          f"({BACKGROUND_LOAD_THREADS} threads)" if async_loads else
                          "in-step loads, a step's blocks to one reader pool in request order")
                + "; DE: a stage's blocks to the node's one reader pool, stages in arrival order"),
    }


@dataclass
class StepPlan:
    """What the worker does in one engine step: loads before the layers run, saves after."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    remote_loads: list[RemoteLoad] = field(default_factory=list)
    pushes: list[Push] = field(default_factory=list)
    xfer_loads: list[XferLoad] = field(default_factory=list)
    async_loads: list[BlockTransfer] = field(default_factory=list)
    """Prefill: PE-side reads done in the background (the request waits in vLLM's
    WAITING_FOR_REMOTE_KVS, the engine keeps running others); whole pages, all layers."""
    async_remote_loads: list[RemoteLoad] = field(default_factory=list)
    """Prefill: DE-side pulls done in the background, likewise."""

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.remote_loads or self.pushes
                    or self.xfer_loads or self.async_loads or self.async_remote_loads)
