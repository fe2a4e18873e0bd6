"""The block store: Full Blocks on a filesystem path, keyed by prefix-chained block keys.

Layout (under `root`, which may be a local folder or a 3FS / NFS mount; all engine processes of
all nodes open the same root):

    root/store.json                    {"format": ..., "full_block_bytes": N}; fixed per store
    root/<kk>/<key hex>.blk            one file per Full Block; <kk> = first key byte (256 dirs)
    root/.tmp/.tmp-<key hex>-<host>-<pid>-<n>   a write in progress (never read); <host> is a
                                       tag of the writer's host name, <n> unique in its process

    .blk file = header (64 B, `store.format`) + payload (full_block_bytes B)

Why one file per Full Block: storage I/O always moves whole Full Blocks (paper §4.1), so a
block is read with one `open` + one `preadv` of a contiguous extent (header and payload land in
preallocated buffers in one system call; a block over `READ_CHUNK_BYTES`, one `preadv` per
piece, each checksummed while in the caches). Files per Layer Block would multiply the file
count and the per-read open/metadata cost by `num_layers` (30 for SmolLM2) for no benefit, since
no reader ever wants a single layer from storage. A Full Block is `num_layers * block_size *
kv_bytes_per_token_per_layer` (2.9 MB for SmolLM2 in fp32 at 64 tokens), well above the size
where per-file overhead matters. One file per block (rather than append-only segments) keeps
writers on different nodes independent: there is no shared index to update, a block becomes
visible to every reader the moment its rename lands, and the filesystem is the index, so
`contains` is a `stat`.

Atomicity: `put` writes a temp file in the store's one temp folder, fsyncs it (when
`is_durable`), then `os.replace`s it onto the final name (a rename within one file system,
which POSIX makes atomic). A writer killed at any point leaves at most a `.tmp-*` file,
which readers never open; the final name only ever refers to a complete file.
The first open of a store root in a process removes the temp files of writers on this host
that are no longer running (and any older than an hour). Temps live in `.tmp/` so that this
sweep lists one small folder, not the 256 block folders and every block in them (on a
network file system, pages of entries fetched one round trip at a time, by every worker,
side channel and router that opens the store); the open that creates `.tmp/` walks the
block folders once, for temps that earlier versions left beside the blocks. A put that
fails (a full disk, a read-only mount) removes its temp file, is counted in
`num_failed_puts` and raises; callers that persist KV in the background count it and carry
on (the block is a later cache miss).

Capacity (optional, `capacity_bytes`): the store keeps about that many bytes of block files
and evicts whole blocks, least recently used first (the later of a file's atime and mtime; a
hit refreshes the atime once a minute, whatever the mount's atime policy), down to
`EVICT_TO` of it. A writer keeps an estimate (the last scan's total plus what it wrote since)
and scans the store when that passes the capacity; blocks other processes write count from
its next scan, so several writers together may pass the capacity for a while. A write in
progress is a temp file, never evicted, and a put never evicts the block it just wrote. An
evicted block is a later miss (recompute), and a reader that has it open reads it whole.

Integrity: every read checks the magic, the key, the size and the CRC32C of the payload (the
SSE4.2 instruction, ~15 GB/s, so verification costs a few percent of a read); a block
that fails is counted as corrupt, removed, and reported as a miss, so the caller recomputes it
and a later `put` rewrites it. Whatever else sits at a block's path and cannot be read (a
directory, a FIFO, a file without read permission, an I/O error) is counted as unreadable and
reported as a miss. Nothing is lost: a miss only costs recompute. `docs/reliability.md` has
the whole list of promises and the tests that hold them.

Permissions: every file and folder the store creates is readable by its owner only
(`file_mode`, default 0o600; folders get the matching search bits), whatever the umask,
since blocks hold prompt content. A store shared by several users needs a group mode (0o640)
and a shared group on the root; a store shared between trust domains needs keys that keep
their requests apart (the vLLM connector's key namespace) and a filesystem that enforces the
mode on every host.
"""

from dualpath.store.block_store import (
    CRC_RELEASE_GIL_BYTES,
    DEFAULT_FILE_MODE,
    BlockStore,
    StoreCounters,
    StoreError,
    store_file_mode,
)
from dualpath.store.format import HEADER_BYTES

__all__ = [
    "CRC_RELEASE_GIL_BYTES",
    "DEFAULT_FILE_MODE",
    "HEADER_BYTES",
    "BlockStore",
    "StoreCounters",
    "StoreError",
    "store_file_mode",
]
