"""What a `DualPathConnector` publishes beside its store, for the router and other readers.

Every connector writes `root/vllm/<namespace hex>.json` when it opens the store: the key
namespace it chains block keys from, the block size and the Full Block bytes, and the model it
serves. The router (`dualpath route`) reads it to count a prompt's stored prefix exactly as the
connectors will (same keys, same store, the one rule `core.blocks.hit_blocks`), without
importing vllm. The block store ignores the folder (its blocks are `root/<kk>/<key>.blk`).

With tensor or pipeline parallelism a block is one file per worker (`Shard`): the manifest
records the parallelism, and a block counts as stored when its last shard is.

Also here: `kv_transfer_params`, the fields the router and the connectors exchange through
vLLM's per-request `kv_transfer_params` (one dict under the key "dualpath").
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dualpath.core.blocks import KeyScope, block_keys, hit_blocks
from dualpath.core.datafile import write_text_atomic
from dualpath.core.errors import SpecError

MANIFEST_DIR = "vllm"
SIDE_CHANNEL_SECRET_ENV = "DUALPATH_SIDE_CHANNEL_SECRET"
"""The environment variable that carries a cluster's side-channel secret to its instances
(the launcher sets it, the connector's staging service and prefill workers read it)."""
PARAMS_KEY = "dualpath"
"""The key of DualPath's fields inside a request's `kv_transfer_params`."""


@dataclass(frozen=True)
class Shard:
    """The part of every block's KV that one vLLM worker holds: its tensor-parallel rank's KV
    heads of its pipeline stage's layers. Each shard is a file of its own in the store, under
    `key(block key)`, and has its own side channel and transfers in P/D.

    The block keys the scheduler plans with are rank-agnostic (every worker gets the same
    plan); each worker maps them to its shard's keys. With one shard (TP 1, PP 1) a shard key
    is the block key itself, so such stores keep their blocks and need no migration."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        for name, rank, size in (("tp_rank", self.tp_rank, self.tp_size),
                                 ("pp_rank", self.pp_rank, self.pp_size)):
            if size < 1 or not 0 <= rank < size:
                raise SpecError("vllm connector", name, rank, f"must be in [0, {size})")

    @classmethod
    def last(cls, tp_size: int = 1, pp_size: int = 1) -> Shard:
        """The shard whose presence counts a block as stored (`StoreManifest.stored_key`)."""
        return cls(tp_size - 1, tp_size, pp_size - 1, pp_size)

    @property
    def num_shards(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def index(self) -> int:
        """This shard's place among all of a block's shards (0 .. num_shards - 1)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    def key(self, key: bytes) -> bytes:
        """This shard's store key of the block `key`: H(key, tp rank, tp size, pp rank, pp
        size), or `key` itself when a block has one shard."""
        if self.num_shards == 1:
            return key
        h = hashlib.blake2b(key, digest_size=len(key), person=b"dualpath-shard")
        h.update(struct.pack("<4I", self.tp_rank, self.tp_size, self.pp_rank, self.pp_size))
        return h.digest()

    def xfer(self, xfer: str) -> str:
        """This shard's name of a P/D transfer: the prefill and decode workers of the same
        rank use it, so no two ranks ever share staging slots, even on one side channel."""
        return xfer if self.num_shards == 1 else f"{xfer}#{self.index}/{self.num_shards}"

    def side_channel(self, address: str) -> str:
        """This shard's decode side channel: the instance's `host:port` with the port offset
        by `index` (a decode instance's ranks each serve their own staging buffer)."""
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise SpecError("vllm connector", "side_channel", address, "must be host:port")
        return f"{host}:{int(port) + self.index}"


@dataclass(frozen=True)
class StoreManifest:
    """One connector's key namespace and block format in a store."""

    namespace: str
    """Hex of the parent key of every block chain (`key_namespace.namespace_key`)."""
    model: str
    block_size: int
    full_block_bytes: int
    """One shard's (a TP rank's heads of a PP stage's layers) bytes per block."""
    tp_size: int = 1
    pp_size: int = 1
    """The instances' parallelism: a block is `tp_size * pp_size` shard files (`Shard`)."""
    blocks_per_file: int = 1
    """Blocks in one store file (g): file `i` holds blocks `[i * g, (i + 1) * g)` of a prompt
    under the key of its last one, and a hit counts whole files (`core.blocks.hit_blocks`)."""

    def __post_init__(self) -> None:
        if self.blocks_per_file < 1:
            raise SpecError("store manifest", "blocks_per_file", self.blocks_per_file,
                            "must be an integer >= 1")

    @property
    def namespace_bytes(self) -> bytes:
        return bytes.fromhex(self.namespace)

    @property
    def file_bytes(self) -> int:
        """One shard's bytes per store file (`BlockStore.full_block_bytes`)."""
        return self.full_block_bytes * self.blocks_per_file

    def stored_key(self, key: bytes) -> bytes:
        """The file whose presence counts block `key` as stored: the last shard's
        (`Shard.last`). Any one shard's file is only a hint that the others exist, and a
        missing one is a load error (recompute) on its rank, never wrong KV; the last is the
        better hint under pipeline parallelism, whose last stage computes a block's KV, and
        so saves it, after the earlier stages have saved theirs in the same step. Checking
        every shard would cost `tp_size * pp_size` metadata operations per block."""
        return Shard.last(self.tp_size, self.pp_size).key(key)

    def hit_blocks(self, tokens: Sequence[int], is_stored: Callable[[bytes], bool],
                   threads: Executor | None = None, scope: KeyScope | None = None) -> int:
        """A prompt's stored prefix in whole blocks (whole files of `blocks_per_file`), as the
        connectors find it: the one rule, `core.blocks.hit_blocks`, over keys chained from
        this namespace within the request's `scope` (each file's `stored_key`). With
        `threads`, `is_stored` runs on them in waves from file 0 on, stopping after the first
        wave with a file missing (`in_waves`): the same count."""
        keys = block_keys(tokens, self.block_size, self.namespace_bytes, scope)
        g = self.blocks_per_file

        def check(key: bytes) -> bool:
            return is_stored(self.stored_key(key))
        return hit_blocks(keys, len(tokens), check if threads is None else
                          in_waves(keys[g - 1::g], check, threads), self.block_size,
                          blocks_per_file=g)

    def write(self, store_root: Path | str) -> Path:
        """Write (atomically) `root/vllm/<namespace>.json`; the same content twice is a no-op."""
        folder = Path(store_root) / MANIFEST_DIR
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.namespace}.json"
        fields = asdict(self)
        if self.blocks_per_file == 1:  # as manifests were before files held several blocks
            del fields["blocks_per_file"]
        text = json.dumps(fields, indent=1, sort_keys=True) + "\n"
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            write_text_atomic(path, text)
        return path


FIRST_WAVE = 16
MAX_WAVE = 256
PARALLEL_ABOVE_S = 50e-6
"""Checks slower than this on average (a network file system's metadata round trip) run in
parallel waves; faster ones (local, cached metadata) one by one, where a thread hand-off
costs more than the check."""


def in_waves(keys: Sequence[bytes], is_stored: Callable[[bytes], bool],
             threads: Executor) -> Callable[[bytes], bool]:
    """`is_stored` over `keys`, asked in order, answered from waves: the first ask of block
    `i` checks blocks `i..i+w` at once (`w` from `FIRST_WAVE`, doubling to `MAX_WAVE`), on
    `threads` once the first wave (checked one by one, timed) took over `PARALLEL_ABOVE_S`
    per check. A stored prefix has no shortcut: blocks need not be stored contiguously (a
    failed save, an evicted block, a missing shard), so being stored is not monotone in the
    block index and a binary search could step over a gap; a wave costs one round of
    metadata latency instead of `w`, and at most `w - 1` checks past the prefix's end."""
    index = {key: i for i, key in enumerate(keys)}
    known: dict[int, bool] = {}
    wave = FIRST_WAVE
    is_parallel = False

    def check(key: bytes) -> bool:
        nonlocal wave, is_parallel
        i = index[key]
        if i not in known:
            batch = [keys[j] for j in range(i, min(len(keys), i + wave))]
            if is_parallel:
                known.update(zip(range(i, i + len(batch)), threads.map(is_stored, batch),
                                 strict=True))
            else:
                t0 = time.perf_counter()
                num_checked = 0
                for j, k in enumerate(batch, i):
                    known[j] = is_stored(k)
                    num_checked += 1
                    if not known[j]:
                        break
                is_parallel = time.perf_counter() - t0 > PARALLEL_ABOVE_S * num_checked
            wave = min(2 * wave, MAX_WAVE)
        return known[i]
    return check


def read_manifests(store_root: Path | str) -> list[StoreManifest]:
    """Every manifest in the store (sorted by file name); a malformed one raises, naming it."""
    out = []
    for path in sorted((Path(store_root) / MANIFEST_DIR).glob("*.json")):
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            out.append(StoreManifest(namespace=str(raw["namespace"]), model=str(raw["model"]),
                                     block_size=int(raw["block_size"]),
                                     full_block_bytes=int(raw["full_block_bytes"]),
                                     tp_size=int(raw.get("tp_size", 1)),
                                     pp_size=int(raw.get("pp_size", 1)),
                                     blocks_per_file=int(raw.get("blocks_per_file", 1))))
        except (ValueError, KeyError, TypeError) as e:
            raise SpecError(str(path), "manifest", type(e).__name__, f"unreadable: {e}") from e
    return out


def find_manifest(store_root: Path | str, model: str | None = None) -> StoreManifest:
    """The manifest of `model` (or the only one); a clear error when none or several match."""
    found = read_manifests(store_root)
    if model is not None:
        named = [m for m in found if m.model == model]
        found = named or found
    if len(found) != 1:
        what = "no vLLM connector has opened it yet" if not found else (
            f"{len(found)} models use it: " + ", ".join(sorted(m.model for m in found)))
        raise SpecError("store", str(store_root), model or "", f"no single manifest: {what}")
    return found[0]


@dataclass(frozen=True)
class RouteParams:
    """The router's per-request orders to the prefill instance (and, returned by it, to the
    decode instance), carried as `kv_transfer_params["dualpath"]`.

    Blocks `[0, pe_blocks)` of the prompt are read from storage by the prefill instance (PE
    read path), blocks `[pe_blocks, hit_blocks)` by the decode instance into its host buffer,
    which the prefill instance pulls over NIXL (DE read path). After the prefill, the prefill
    instance pushes every block the decode instance lacks (the PE-read and the computed ones,
    the partial tail included) into the decode instance's buffer under `xfer`.
    """

    xfer: str
    """A unique id of this request's transfers (the router's)."""
    de: str
    """host:port of the decode instance's side channel."""
    hit_blocks: int
    pe_blocks: int
    tokens: int = 0
    """Set by the prefill instance in its reply: prompt tokens whose KV it pushed."""

    def __post_init__(self) -> None:
        if not 0 <= self.pe_blocks <= self.hit_blocks:
            raise SpecError("kv_transfer_params.dualpath", "pe_blocks", self.pe_blocks,
                            f"must be in [0, hit_blocks={self.hit_blocks}]")
        if not self.xfer or ":" not in self.de:
            raise SpecError("kv_transfer_params.dualpath", "de", self.de, "must be host:port")

    @property
    def de_blocks(self) -> int:
        return self.hit_blocks - self.pe_blocks

    def to_params(self) -> dict[str, Any]:
        """The request's `kv_transfer_params`."""
        return {PARAMS_KEY: asdict(self)}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> RouteParams | None:
        """The fields of a request's `kv_transfer_params`, or None when it has none of ours."""
        if not params or PARAMS_KEY not in params:
            return None
        raw = params[PARAMS_KEY]
        try:
            return cls(xfer=str(raw["xfer"]), de=str(raw["de"]),
                       hit_blocks=int(raw["hit_blocks"]), pe_blocks=int(raw["pe_blocks"]),
                       tokens=int(raw.get("tokens", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise SpecError("kv_transfer_params", PARAMS_KEY, raw, f"malformed: {e}") from e


LOADS_KEY = "loads"
"""Where a prefill instance's reply puts its `LoadReport`, beside the `RouteParams` fields."""


@dataclass(frozen=True)
class LoadReport:
    """What a prefill instance's connector actually loaded of a request's stored prefix (its
    reply's `kv_transfer_params["dualpath"]["loads"]`), counted from the loads themselves: a
    block whose load failed, and every later one of the request (vLLM recomputes from the
    first failed block on), is recomputed, not loaded."""

    pe_blocks: int
    """Blocks read from the store by the prefill node (PE read path)."""
    de_blocks: int
    """Blocks read by the decode node and pulled from its staging buffer (DE read path)."""
    recomputed_blocks: int
    """Blocks planned to load that were computed instead."""

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> LoadReport | None:
        """The report in a prefill reply's `kv_transfer_params`, or None when it has none."""
        raw = (params or {}).get(PARAMS_KEY)
        loads = raw.get(LOADS_KEY) if isinstance(raw, Mapping) else None
        if not isinstance(loads, Mapping):
            return None
        try:
            report = cls(int(loads["pe_blocks"]), int(loads["de_blocks"]),
                         int(loads["recomputed_blocks"]))
        except (KeyError, TypeError, ValueError) as e:
            raise SpecError("kv_transfer_params", LOADS_KEY, loads, f"malformed: {e}") from e
        if min(report.pe_blocks, report.de_blocks, report.recomputed_blocks) < 0:
            raise SpecError("kv_transfer_params", LOADS_KEY, loads, "counts must be >= 0")
        return report
