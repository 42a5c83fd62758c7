"""Bounded KV buffers: D's receive buffer (spilling into a host pool) and P's send store.

Every entry ends: taken by a load, discarded with its request, evicted (send store, FIFO over
its byte budget) or expired after `ttl_s` unclaimed. Nothing grows without bound.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from kvx.plugins.p2p.messages import TensorMeta
from kvx.plugins.p2p.tensors import Segments

logger = logging.getLogger(__name__)
RecvKey = tuple[str, str, int]
"""(P's request id, layer, first global KV head)."""
REFUSALS_KEPT = 4096
MAX_RECV_ENTRIES = 1 << 16
"""Slices the receive buffer holds or has admitted at once, whatever their bytes (a flood of
zero-byte PUTs is refused past it)."""


@dataclass
class Entry:
    meta: TensorMeta
    segments: Segments
    nbytes: int
    spilled: bool
    expires: float
    keep: Any = None
    """What must outlive `segments` (the received frames they view)."""


class RecvBuffer:
    """Received KV until D loads it: up to `device_bytes` where it arrived, then up to
    `pool_bytes` in host memory (a CUDA tensor is moved there); beyond both, `admit` refuses
    and the request is remembered as refused so D fails it at once instead of waiting."""

    def __init__(
        self, device_bytes: int, pool_bytes: int, ttl_s: float, max_entries: int = MAX_RECV_ENTRIES
    ) -> None:
        self.device_bytes, self.pool_bytes, self.ttl_s = device_bytes, pool_bytes, ttl_s
        self.max_entries = max_entries
        self._entries: dict[RecvKey, Entry] = {}
        """In the order they expire (one ttl for all; a replaced key moves to the end)."""
        self._admitted = 0
        """Slices admitted whose tensor has not been put (or unreserved) yet."""
        self._used_device = self._used_pool = 0
        self._refused: OrderedDict[str, float] = OrderedDict()
        self._cond = threading.Condition()
        self.spilled_count = 0

    def admit(self, meta: TensorMeta) -> str | None:
        """None if a tensor of `meta.nbytes` fits (its bytes are reserved), else why not."""
        with self._cond:
            self._expire(time.monotonic())
            n = meta.nbytes
            if len(self._entries) + self._admitted >= self.max_entries:
                why = f"receive buffer full: it holds {self.max_entries} slices (the most it takes)"
            elif self._used_device + n <= self.device_bytes:
                self._used_device += n
                self._admitted += 1
                return None
            elif self._used_pool + n <= self.pool_bytes:
                self._used_pool += n
                self._admitted += 1
                return "spill"
            else:
                why = (
                    f"receive buffer full: {self._used_device} of kv_buffer_size "
                    f"{self.device_bytes} and {self._used_pool} of mem_pool_size_gb "
                    f"{self.pool_bytes} bytes in use, {n} more asked"
                )
            self._refused[meta.request_id] = time.monotonic() + self.ttl_s
            while len(self._refused) > REFUSALS_KEPT:
                self._refused.popitem(last=False)
            return why

    def put(
        self, key: RecvKey, meta: TensorMeta, segments: Segments, spill: bool, keep: Any = None
    ) -> None:
        self.put_many([(key, meta, segments, spill, keep)])

    def put_many(self, items: list[tuple[RecvKey, TensorMeta, Segments, bool, Any]]) -> None:
        """Keep admitted tensors: (key, meta, segments, spilled, what must outlive them); the
        loader is woken once for all of them."""
        entries = []
        expires = time.monotonic() + self.ttl_s
        for key, meta, segments, spill, keep in items:
            if spill and any(s.device.type != "cpu" for s in segments):
                segments, keep = [s.to("cpu") for s in segments], None
            if spill:
                self.spilled_count += 1
            entries.append((key, Entry(meta, segments, meta.nbytes, spill, expires, keep)))
        if not entries:
            return
        with self._cond:
            self._admitted = max(0, self._admitted - len(entries))
            for key, entry in entries:
                old = self._entries.pop(key, None)
                if old is not None:
                    self._release(old)
                self._entries[key] = entry
            self._cond.notify_all()

    def unreserve(self, nbytes: int, spill: bool) -> None:
        """Give back an `admit`ted reservation whose tensor never arrived."""
        with self._cond:
            self._admitted = max(0, self._admitted - 1)
            if spill:
                self._used_pool -= nbytes
            else:
                self._used_device -= nbytes

    def wait_for(self, keys: list[RecvKey], request_id: str, deadline: float) -> str | None:
        """Block until every key is here (None), the request was refused or time is up
        (why not)."""
        with self._cond:
            while True:
                missing = [k for k in keys if k not in self._entries]
                if not missing:
                    return None
                if request_id in self._refused:
                    return "the receive buffer refused its KV (out of memory)"
                left = deadline - time.monotonic()
                if left <= 0:
                    return (
                        f"{len(missing)} of {len(keys)} KV slices never arrived, e.g. {missing[0]}"
                    )
                self._cond.wait(min(left, 0.5))

    def wait_any(self, keys: list[RecvKey], deadline: float) -> tuple[list[RecvKey], set[str]]:
        """Block until some of `keys` are here or one of their requests was refused: (the keys
        here, the refused request ids); both empty once `deadline` passed."""
        with self._cond:
            while True:
                here = [k for k in keys if k in self._entries]
                refused = {k[0] for k in keys if k[0] in self._refused}
                left = deadline - time.monotonic()
                if here or refused or left <= 0:
                    return here, refused
                self._cond.wait(min(left, 0.5))

    def take(self, key: RecvKey, device: torch.device) -> tuple[TensorMeta, Segments]:
        with self._cond:
            entry = self._entries.pop(key)
            self._release(entry)
        return entry.meta, [s.to(device) for s in entry.segments]

    def discard(self, request_id: str) -> int:
        """Drop everything held for `request_id`; how many entries."""
        with self._cond:
            self._refused.pop(request_id, None)
            keys = [k for k in self._entries if k[0] == request_id]
            for key in keys:
                self._release(self._entries.pop(key))
            return len(keys)

    def _release(self, entry: Entry) -> None:
        if entry.spilled:
            self._used_pool -= entry.nbytes
        else:
            self._used_device -= entry.nbytes

    def _expire(self, now: float) -> None:
        """Drop what expired: the oldest entries first, stopping at the first still valid
        (O(1) per call besides what it drops)."""
        dropped = 0
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.expires > now:
                break
            self._release(self._entries.pop(key))
            dropped += 1
        if dropped:
            logger.warning("dropped %d unclaimed KV slices after %.0fs", dropped, self.ttl_s)
        while self._refused and next(iter(self._refused.values())) <= now:
            self._refused.popitem(last=False)

    def expire(self) -> None:
        with self._cond:
            self._expire(time.monotonic())

    @property
    def used_bytes(self) -> int:
        return self._used_device + self._used_pool

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class Stored:
    meta: TensorMeta
    tensor: torch.Tensor
    expires: float
    served: int = 0


class SendStore:
    """P's KV for D to pull (GET): FIFO-evicted over `max_bytes`, expired after `ttl_s`,
    dropped once as many readers as D announced have read it. A tensor larger than the whole
    budget is not kept (vLLM's threshold rule)."""

    def __init__(self, max_bytes: int, ttl_s: float) -> None:
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self._items: OrderedDict[tuple[str, str], Stored] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self.evicted = 0

    def put(self, meta: TensorMeta, tensor: torch.Tensor) -> bool:
        n = meta.nbytes
        if n > self.max_bytes:
            logger.warning(
                "%s#%s: %d bytes exceed kv_buffer_size %d; not kept for D to pull",
                meta.request_id,
                meta.layer,
                n,
                self.max_bytes,
            )
            return False
        with self._lock:
            self._drop((meta.request_id, meta.layer))
            while self._used + n > self.max_bytes and self._items:
                key, old = self._items.popitem(last=False)
                self._used -= old.meta.nbytes
                self.evicted += 1
                logger.warning("send store full: evicted %s#%s before D pulled it", *key)
            self._items[(meta.request_id, meta.layer)] = Stored(
                meta, tensor, time.monotonic() + self.ttl_s
            )
            self._used += n
        return True

    def lookup(self, request_id: str, layer: str) -> Stored | None:
        with self._lock:
            self._expire(time.monotonic())
            return self._items.get((request_id, layer))

    def served(self, request_id: str, layer: str, readers: int) -> None:
        """One D worker read the entry; drop it once `readers` have."""
        with self._lock:
            item = self._items.get((request_id, layer))
            if item is None:
                return
            item.served += 1
            if item.served >= readers:
                self._drop((request_id, layer))

    def discard(self, request_id: str) -> None:
        with self._lock:
            for key in [k for k in self._items if k[0] == request_id]:
                self._drop(key)

    def _drop(self, key: tuple[str, str]) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self._used -= item.meta.nbytes

    def _expire(self, now: float) -> None:
        while self._items:
            key, item = next(iter(self._items.items()))
            if item.expires > now:
                break
            self._drop(key)

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._items)
