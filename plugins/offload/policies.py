"""Eviction policies of the CPU tier: LRU and ARC (adaptive replacement cache).

A policy only orders keys; the manager owns slots and pins. `evictable` filters keys that are
pinned by in-flight loads or stores.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class LRUPolicy:
    """Least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._order: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._order

    def touch(self, key: str) -> None:
        self._order.move_to_end(key)

    def insert(self, key: str) -> None:
        self._order[key] = None

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Callable[[str], bool]) -> str | None:
        return next((k for k in self._order if evictable(k)), None)


class ARCPolicy:
    """ARC: a recency list T1 and a frequency list T2 with ghost lists B1/B2 that adapt the
    target size `p` of T1 on ghost hits (Megiddo & Modha)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.p = 0
        self.t1: OrderedDict[str, None] = OrderedDict()
        self.t2: OrderedDict[str, None] = OrderedDict()
        self.b1: OrderedDict[str, None] = OrderedDict()
        self.b2: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self.t1 or key in self.t2

    def touch(self, key: str) -> None:
        """A hit: the key moves to (or within) the frequency list."""
        self.t1.pop(key, None)
        self.t2[key] = None
        self.t2.move_to_end(key)

    def insert(self, key: str) -> None:
        if key in self.b1:  # recency ghost hit: favour recency
            self.p = min(self.capacity, self.p + max(1, len(self.b2) // max(1, len(self.b1))))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:  # frequency ghost hit: favour frequency
            self.p = max(0, self.p - max(1, len(self.b1) // max(1, len(self.b2))))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        for ghosts in (self.b1, self.b2):
            while len(ghosts) > self.capacity:
                ghosts.popitem(last=False)

    def remove(self, key: str) -> None:
        """Evicted (or dropped): remember it as a ghost of the list it left."""
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None

    def victim(self, evictable: Callable[[str], bool]) -> str | None:
        first, second = (self.t1, self.t2) if len(self.t1) > max(self.p, 0) else (self.t2, self.t1)
        for candidates in (first, second):
            key = next((k for k in candidates if evictable(k)), None)
            if key is not None:
                return key
        return None


POLICIES: dict[str, type[LRUPolicy | ARCPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}
