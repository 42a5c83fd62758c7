"""Backing registered CPU KV caches with transparent huge pages before NIXL registers them.

On one machine UCX moves DRAM with `cma` (`process_vm_readv`): the kernel pins the peer's
pages one 4 KiB page at a time before copying. Profiled on a 256 MiB READ, a third of the
copy's CPU time was that page walk (`follow_page_pte`); over 2 MiB pages the walk is one step
per 512 pages, and raw NIXL's CPU time per byte dropped from ~2.3x to ~1.2x memcpy's (see
docs/performance.md). The engine allocated (and touched) the cache already, so asking for huge
pages (`MADV_HUGEPAGE`) is not enough: `MADV_COLLAPSE` (Linux 6.1+) rebuilds the touched
range on huge pages in place (same addresses and bytes; it costs one copy of the cache at
registration). Where the kernel cannot, the cache keeps its pages and a debug line says why.

A tensor rarely starts or ends on a 2 MiB boundary (glibc puts a header before an mmap'd
allocation), so the 2 MiB pages that hold its first and last bytes also hold bytes beside it.
Left on 4 KiB pages they cost the READs of the first and the last requests ~0.8 ms of D's CPU
each per 256 MiB round. They are collapsed too, with `MADV_COLLAPSE` alone: the neighbouring
bytes (a header, the next layer's tensor) keep their addresses, contents and THP policy; an
unused neighbour page gets memory, at most 2 MiB per edge. An edge that is not inside one
mapping stays as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Callable, Iterable

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_range(tensor: torch.Tensor) -> tuple[int, int]:
    """(start, length) of the whole 2 MiB pages inside the tensor's bytes (length 0: none)."""
    begin = tensor.data_ptr()
    end = begin + tensor.numel() * tensor.element_size()
    start = -(-begin // HUGE_PAGE) * HUGE_PAGE
    stop = end // HUGE_PAGE * HUGE_PAGE
    return start, max(0, stop - start)


def edge_pages(tensor: torch.Tensor) -> dict[int, int]:
    """The 2 MiB pages that hold some of the tensor's bytes and some bytes beside it: their
    start and how many of the tensor's bytes each holds."""
    begin = tensor.data_ptr()
    end = begin + tensor.numel() * tensor.element_size()
    edges = {}
    for page in {begin // HUGE_PAGE * HUGE_PAGE, (end - 1) // HUGE_PAGE * HUGE_PAGE}:
        if end > begin and (page < begin or page + HUGE_PAGE > end):
            edges[page] = min(end, page + HUGE_PAGE) - max(begin, page)
    return edges


def collapse_to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Advise and collapse the CPU tensors' whole 2 MiB ranges onto huge pages, then collapse
    the 2 MiB pages at their edges; returns the bytes the kernel collapsed. Never raises: a
    kernel without THP or MADV_COLLAPSE, or no free huge page, leaves the memory as it was."""
    madvise = _madvise()
    if madvise is None:
        return 0
    done = 0
    edges: dict[int, int] = {}  # page -> the tensors' bytes on it
    for tensor in tensors:
        if tensor.device.type != "cpu":
            continue
        for page, nbytes in edge_pages(tensor).items():
            edges[page] = edges.get(page, 0) + nbytes
        start, length = huge_range(tensor)
        if not length:
            continue
        for advice, name in ((MADV_HUGEPAGE, "MADV_HUGEPAGE"), (MADV_COLLAPSE, "MADV_COLLAPSE")):
            if madvise(start, length, advice) != 0:
                err = ctypes.get_errno()
                logger.debug(
                    "%s on %d MiB of KV cache failed: %s", name, length >> 20, os.strerror(err)
                )
                break
        else:
            done += length
    for page, nbytes in sorted(edges.items()):  # COLLAPSE only: neighbours keep their policy
        if madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0:
            done += nbytes
        else:
            err = ctypes.get_errno()
            logger.debug("MADV_COLLAPSE of a KV cache edge failed: %s", os.strerror(err))
    return done
