"""Memory the storage worker reuses: a byte budget for values being written, and pools of
value buffers."""

from __future__ import annotations

import threading

import torch


class Budget:
    """Bytes the writer may hold at once; a save waits for room (one oversized job may run
    alone)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n

    def release(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()


class BufferPool:
    """Byte buffers kept for reuse (up to `keep` bytes): fresh memory costs a page fault per
    4 KiB page on first touch, about as much as the copy into it."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.free: list[torch.Tensor] = []
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of at least `nbytes` (contents undefined)."""
        with self.lock:
            fits = [b for b in self.free if b.numel() >= nbytes]
            if fits:
                best = min(fits, key=lambda b: b.numel())
                self.free = [b for b in self.free if b is not best]
                return best
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        with self.lock:
            self.free.append(buf)
            self.free.sort(key=lambda b: b.numel(), reverse=True)
            while sum(b.numel() for b in self.free) > self.keep:
                self.free.pop()


def row_views(flat: torch.Tensor, count: int, row_bytes: int, at: int = 0) -> torch.Tensor:
    """`count` rows of `row_bytes` of a flat buffer, from byte `at`."""
    return flat[at : at + count * row_bytes].view(count, row_bytes)
