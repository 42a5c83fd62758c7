"""Types of the native module built from `_fileio.c` (see its method table for the behaviour)."""

from collections.abc import Sequence

from typing_extensions import Buffer

_Region = tuple[Buffer, int, int, int]  # (buffer, start, size, step)

def hash_buffers(buffers: Sequence[Buffer], /) -> int: ...
def write_blocks(
    paths: Sequence[str],
    tmp_paths: Sequence[str],
    seeds: Sequence[bytes],
    prefix: Buffer,
    regions: Sequence[_Region],
    blocks: Sequence[int],
    baseline: bool = False,
    mode: int = 0o600,
    /,
) -> list[int]: ...
def read_blocks(
    paths: Sequence[str],
    seeds: Sequence[bytes],
    skip_start: int,
    skip_end: int,
    heads: Sequence[Buffer],
    regions: Sequence[_Region],
    blocks: Sequence[int],
    baseline: bool = False,
    keys: Sequence[bytes] | None = None,
    hashed: bool = True,
    /,
) -> list[tuple[int | None, int | None, int]]: ...
def write_segment(
    paths: Sequence[str],
    keys: Sequence[bytes],
    tmp_path: str,
    seeds: Sequence[bytes],
    prefix: Buffer,
    regions: Sequence[_Region],
    blocks: Sequence[int],
    baseline: bool = False,
    mode: int = 0o600,
    /,
) -> list[int]: ...
def vector() -> str: ...
