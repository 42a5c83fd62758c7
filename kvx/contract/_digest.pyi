"""Types of the native module built from `_digest.c` (see its method table for the behaviour)."""

from collections.abc import Sequence

from typing_extensions import Buffer

_Region = tuple[Buffer, int, int, int]  # (buffer, start, size, step)

def region_digests(
    regions: Sequence[_Region], blocks: Sequence[int], parts: int = 1, merge: bool = False, /
) -> list[int]: ...
def merge_digests(digests: Sequence[int], parts: int, first: int, count: int, /) -> list[int]: ...
def chunk_digests(buffers: Sequence[Buffer], num_blocks: int, outer: int, /) -> list[int]: ...
def vector() -> str: ...
