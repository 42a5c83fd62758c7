"""Segment files (`_segment.c`): several values in one local file, each hard-linked under its
own key, found through an index in the file's header. Written by the native `write_segment`
(version 2); this module finds a key's value for the Python read paths (`get_many`,
`get_vectored`), in segments of version 2 and of version 1.

A file whose size is the size the reader expects is a value of its own: files written one per
value (block format 3 stores, batches of one value) are read as they always were.

The format is defined by the C sources (`_fileio.h`, `_segment.c`); the constants below restate
it for this reader, and tests/storage/test_segment_format.py fails when the two differ.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import xxhash

# TODO: generate these from _fileio.h at build time instead of restating them (until then
# tests/storage/test_segment_format.py fails when the two differ)
MAGIC = b"KVXS"
VERSION = 2  # written; version 1 is still read
VERSIONS = (1, 2)
FIXED = struct.Struct("<4sHHII")  # magic, version, zero, count, header_len
ENTRY = struct.Struct("<QQQ")  # version 1: key hash, offset, length
V2_FIXED = struct.Struct("<4sHHIIIIQQ")  # ..., head_len, zero, payload_len, data_start
V2_ENTRY = struct.Struct("<QQ")  # key hash, the value's checksum
ALIGN = 4096
DATA_ALIGN = 2 << 20  # version 2: payloads start on a 2 MiB boundary
MAX_VALUES = 4096
MAX_HEAD = 4096


class SegmentVersionError(ValueError):
    """A segment file of a version this reader does not know (written by a newer kvx)."""


@dataclass(frozen=True)
class Located:
    """Where a key's value lies in a segment: `head` (version 2: the value's header, kept in
    the index; empty for version 1, where it is in the file), then `length` bytes of the file
    from `offset`."""

    head: bytes
    offset: int
    length: int

    @property
    def size(self) -> int:
        """The value's bytes: its header and its payload."""
        return len(self.head) + self.length


def header_len(count: int, head_len: int | None = None) -> int:
    """Bytes before a segment's first value (version 1), or its index's bytes (version 2,
    values with headers of `head_len` bytes)."""
    if head_len is None:
        used = FIXED.size + ENTRY.size * count + 8
    else:
        used = V2_FIXED.size + head_len - 8 + V2_ENTRY.size * count + 8
    return -(-used // ALIGN) * ALIGN


def data_start(count: int, head_len: int) -> int:
    """Where the payloads of a version-2 segment begin."""
    return -(-header_len(count, head_len) // DATA_ALIGN) * DATA_ALIGN


def locate(fd: int, size: int, key: str, path: str = "") -> Located | None:
    """Where `key`'s value lies if the open file `fd` of `size` bytes (at `path`, for
    messages) is a well-formed segment holding it, else None (a plain value, or not this
    key's segment). Raise `SegmentVersionError` for a segment of an unknown version."""
    if size < ALIGN:
        return None
    first = os.pread(fd, ALIGN, 0)
    if len(first) < FIXED.size + 8 or first[:4] != MAGIC:
        return None
    _, version, zero, count, hlen = FIXED.unpack_from(first)
    if version not in VERSIONS:
        raise SegmentVersionError(
            f"{path or 'a file'}: a segment file of version {version}; this kvx reads segment "
            f"versions {' and '.join(map(str, VERSIONS))} (written by a newer kvx? load it "
            "with that one, or remove the file)"
        )
    if zero or not 0 < count <= MAX_VALUES:
        return None
    want = xxhash.xxh3_64_intdigest(key.encode())
    if version == 1:
        used = FIXED.size + ENTRY.size * count
        if hlen != header_len(count) or hlen > size:
            return None
        head = _checked(fd, first, used)
        for i in range(count if head else 0):
            digest, offset, length = ENTRY.unpack_from(head, FIXED.size + ENTRY.size * i)
            if digest == want and hlen <= offset and offset + length <= size:
                return Located(b"", offset, length)
        return None
    if len(first) < V2_FIXED.size:
        return None
    *_, head_len, zero2, payload, start = V2_FIXED.unpack_from(first)
    if (
        zero2
        or not 8 <= head_len <= MAX_HEAD
        or hlen != header_len(count, head_len)
        or start % ALIGN
        or not hlen <= start <= size
        or payload > (size - start) // count
    ):
        return None
    entries = V2_FIXED.size + head_len - 8
    head = _checked(fd, first, entries + V2_ENTRY.size * count)
    for i in range(count if head else 0):
        digest, checksum = V2_ENTRY.unpack_from(head, entries + V2_ENTRY.size * i)
        if digest == want:
            value_head = head[V2_FIXED.size : entries] + checksum.to_bytes(8, "little")
            return Located(value_head, start + i * payload, payload)
    return None


def _checked(fd: int, first: bytes, used: int) -> bytes:
    """The file's first `used` bytes if the 8 after them are their XXH3-64, else b""."""
    head = first if used + 8 <= len(first) else first + os.pread(fd, used + 8 - len(first), ALIGN)
    if len(head) < used + 8 or xxhash.xxh3_64_intdigest(head[:used]) != int.from_bytes(
        head[used : used + 8], "little"
    ):
        return b""
    return head
