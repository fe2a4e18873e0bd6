"""The block file's on-disk format: a 64-byte checksummed header, then the payload.

    header = magic "DPKVBLK1" | version u16 | key length u16 | payload bytes u64 |
             payload crc32c u32 | header crc32c u32 | key (32 B, zero padded) | pad

Every header byte is checked on read, so a block is served only when the file holds exactly
the bytes written for that key.
"""

from __future__ import annotations

import struct

import crc32c

FORMAT = "dualpath-blockstore-v1"
"""`store.json`'s format tag: a store of another format is refused when opened."""
MAGIC = b"DPKVBLK1"
VERSION = 1
MAX_KEY_BYTES = 32
HEADER_BYTES = 64
_FIXED = struct.Struct("<8sHHQI")  # magic, version, key length, payload bytes, payload crc32c
_HEADER_CRC = struct.Struct("<I")
# Header: fixed fields (24 B) | header crc32c (4 B) | key (32 B) | zero pad (4 B) = 64 B.
_KEY_OFFSET = _FIXED.size + _HEADER_CRC.size
assert _KEY_OFFSET + MAX_KEY_BYTES <= HEADER_BYTES


def encode_header(key: bytes, payload_bytes: int, payload_crc: int) -> bytes:
    """The header of the block of `key` whose payload has this size and CRC32C."""
    fixed = _FIXED.pack(MAGIC, VERSION, len(key), payload_bytes, payload_crc)
    key_field = key.ljust(MAX_KEY_BYTES, b"\0")
    header_crc = crc32c.crc32c(key_field, crc32c.crc32c(fixed))
    head = fixed + _HEADER_CRC.pack(header_crc) + key_field
    return head.ljust(HEADER_BYTES, b"\0")


def check_header(header: bytes | bytearray, key: bytes, payload_bytes: int) -> int | None:
    """The payload CRC the header promises, or None when the header is not valid for `key`."""
    magic, version, key_len, size, payload_crc = _FIXED.unpack_from(header, 0)
    (header_crc,) = _HEADER_CRC.unpack_from(header, _FIXED.size)
    mv = memoryview(header)
    key_field = mv[_KEY_OFFSET : _KEY_OFFSET + MAX_KEY_BYTES]
    if crc32c.crc32c(key_field, crc32c.crc32c(mv[: _FIXED.size])) != header_crc:
        return None
    if magic != MAGIC or version != VERSION or size != payload_bytes:
        return None
    if key_len != len(key) or key_field[:key_len] != key:
        return None
    if any(mv[_KEY_OFFSET + MAX_KEY_BYTES :]):  # the pad is zero: every header byte is checked
        return None
    return int(payload_crc)
