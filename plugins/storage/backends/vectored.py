"""Vectored IO over many buffers: byte views of them, and resuming after a partial call."""

from __future__ import annotations

import os
from collections.abc import Sequence


def iov_max() -> int:
    """How many buffers one vectored call (writev, sendmsg...) may take (IOV_MAX; 1024 if
    unknown)."""
    try:
        n = os.sysconf("SC_IOV_MAX")
    except (ValueError, OSError, AttributeError):
        n = -1
    return n if n > 0 else 1024


def byte_views(buffers: Sequence[bytes | memoryview]) -> list[memoryview]:
    """Flat unsigned-byte views of `buffers` (empty ones dropped); each must be contiguous."""
    views = []
    for i, buf in enumerate(buffers):
        view = memoryview(buf)
        if not view.c_contiguous:
            raise ValueError(f"buffer {i} is not C-contiguous; only contiguous buffers are moved")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if view.nbytes:
            views.append(view)
    return views


def advance(views: list[memoryview], i: int, count: int) -> int:
    """Consume `count` bytes of `views` from index `i` (trimming a partly used view in
    place); the index of the first view with bytes left."""
    while count:
        size = views[i].nbytes
        if count < size:
            views[i] = views[i][count:]
            return i
        count -= size
        i += 1
    return i
