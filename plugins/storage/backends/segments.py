"""Segment files (`_segment.c`): several values in one local file, each hard-linked under its
own key, found through an index in the file's header. Written by the native `write_segment`;
this module finds a key's value for the Python read paths (`get_many`, `get_vectored`).

A file whose size is the size the reader expects is a value of its own: files written one per
value (block format 3 stores, batches of one value) are read as they always were.
"""

from __future__ import annotations

import os
import struct

import xxhash

MAGIC = b"KVXS"
VERSION = 1
FIXED = struct.Struct("<4sBBHII")  # magic, version, zero, zero, count, header_len
ENTRY = struct.Struct("<QQQ")  # key hash, offset, length
ALIGN = 4096
MAX_VALUES = 4096


def header_len(count: int) -> int:
    """Bytes before a segment's first value."""
    return -(-(FIXED.size + ENTRY.size * count + 8) // ALIGN) * ALIGN


def locate(fd: int, size: int, key: str) -> tuple[int, int] | None:
    """(offset, length) of `key`'s value if the open file `fd` of `size` bytes is a
    well-formed segment holding it, else None (a plain value, or not this key's segment)."""
    if size < ALIGN:
        return None
    first = os.pread(fd, ALIGN, 0)
    if len(first) < FIXED.size:
        return None
    magic, version, zero, zero2, count, hlen = FIXED.unpack_from(first)
    if (magic, version, zero, zero2) != (MAGIC, VERSION, 0, 0) or not 0 < count <= MAX_VALUES:
        return None
    used = FIXED.size + ENTRY.size * count
    if hlen != header_len(count) or hlen > size:
        return None
    head = first if used + 8 <= len(first) else first + os.pread(fd, used + 8 - len(first), ALIGN)
    if len(head) < used + 8 or xxhash.xxh3_64_intdigest(head[:used]) != int.from_bytes(
        head[used : used + 8], "little"
    ):
        return None
    want = xxhash.xxh3_64_intdigest(key.encode())
    for i in range(count):
        digest, offset, length = ENTRY.unpack_from(head, FIXED.size + ENTRY.size * i)
        if digest == want and hlen <= offset and offset + length <= size:
            return offset, length
    return None
