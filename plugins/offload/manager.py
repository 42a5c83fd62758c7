"""The scheduler side's record of what the tiers hold: CPU slots, the optional disk tier,
pins, eviction and events.

Matches vLLM's OffloadingManager contract: `lookup` counts leading hits, `prepare_load` pins,
`complete_load` unpins, `prepare_store` reserves slots (evicting unpinned keys) or returns None
when nothing can be stored now, `complete_store(success=False)` forgets the keys.
Beyond vLLM (CPU only), a chunk evicted from the CPU tier can spill to a disk tier (LRU) from
which it is still loadable.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvx import BlockRemoved, BlockStored, BlockStoreFailed, KVCacheEvent
from kvx.plugins.offload.policies import POLICIES


@dataclass
class StorePlan:
    keys: list[str]
    slots: list[int]
    evicted: list[str] = field(default_factory=list)
    spills: list[tuple[str, int]] = field(default_factory=list)  # (key, CPU slot) to disk
    disk_drops: list[str] = field(default_factory=list)  # keys whose disk copy goes


class OffloadingManager:
    def __init__(
        self,
        num_slots: int,
        policy: str = "lru",
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
        tokens_per_chunk: int = 0,
        disk_chunks: int = 0,
    ) -> None:
        if num_slots < 1:
            raise ValueError("the CPU tier has room for no chunk; raise cpu_bytes_to_use")
        self.num_slots = num_slots
        self.policy = POLICIES[policy](num_slots)
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.tokens_per_chunk = tokens_per_chunk
        self.slot_of: dict[str, int] = {}
        self.ready: set[str] = set()  # stored and loadable
        self.pins: dict[str, int] = {}
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.offers: OrderedDict[str, int] = OrderedDict()
        self.events: list[KVCacheEvent] = []
        self.disk_chunks = disk_chunks
        self.on_disk: OrderedDict[str, None] = OrderedDict()  # oldest first

    def lookup(self, keys: Sequence[str]) -> int:
        """Number of leading keys that are stored and loadable."""
        count = 0
        for key in keys:
            if key not in self.ready and key not in self.on_disk:
                break
            count += 1
        return count

    def prepare_load(self, keys: Sequence[str]) -> list[int | None]:
        """Pin `keys` against eviction; their CPU slots (None: the key is on disk)."""
        for key in keys:
            self.pins[key] = self.pins.get(key, 0) + 1
            if key in self.on_disk:
                self.on_disk.move_to_end(key)
            else:
                self.policy.touch(key)
        return [self.slot_of.get(k) for k in keys]

    def complete_load(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._unpin(key)

    def prepare_store(self, keys: Sequence[str]) -> StorePlan | None:
        """Slots for the keys worth storing now (already stored, under-offered or in-flight keys
        are left out); None when no slot can be freed."""
        wanted = []
        for key in keys:
            if key in self.slot_of or key in self.on_disk:
                continue
            self.offers[key] = self.offers.get(key, 0) + 1
            self.offers.move_to_end(key)
            while len(self.offers) > self.max_tracker_size:
                self.offers.popitem(last=False)
            if self.offers[key] >= max(1, self.store_threshold):
                wanted.append(key)
        if not wanted:
            return StorePlan([], [])
        plan = StorePlan([], [])
        for key in wanted:
            if not self.free_slots:
                victim = self.policy.victim(lambda k: k in self.ready and not self.pins.get(k))
                if victim is None:
                    break
                slot = self.slot_of[victim]
                if self._spill(victim, plan):
                    plan.spills.append((victim, slot))
                plan.evicted.append(victim)
            slot = self.free_slots.pop()
            self.slot_of[key] = slot
            self.pins[key] = 1  # pinned until the store completes
            plan.keys.append(key)
            plan.slots.append(slot)
        return plan if plan.keys else None

    def complete_store(self, keys: Sequence[str], success: bool = True) -> None:
        for key in keys:
            self._unpin(key)
            if success:
                self.ready.add(key)
                self.policy.insert(key)
                self.offers.pop(key, None)
                self.events.append(
                    BlockStored((bytes.fromhex(key),), None, (), self.tokens_per_chunk, "CPU")
                )
            else:
                self._drop(key, announce=False)
                self.events.append(
                    BlockStoreFailed((bytes.fromhex(key),), "CPU", "a worker's copy failed")
                )

    def spill_failed(self, key: str, reason: str) -> None:
        """A worker could not write chunk `key` to the disk tier: it is not there to load. The
        spill was announced as `BlockStored` (DISK), so its removal is too (once, however
        many workers failed)."""
        if key in self.on_disk:
            del self.on_disk[key]
            self.events.append(BlockStoreFailed((bytes.fromhex(key),), "DISK", reason))
            self.events.append(BlockRemoved((bytes.fromhex(key),), "DISK"))

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def reset(self) -> bool:
        """Forget every unpinned key; False if some are still in use."""
        for key in [k for k in self.slot_of if not self.pins.get(k)]:
            self._drop(key)
        for key in [k for k in self.on_disk if not self.pins.get(k)]:
            del self.on_disk[key]
        return not self.slot_of and not self.on_disk

    def _spill(self, key: str, plan: StorePlan) -> bool:
        """Evict `key` from its CPU slot into the disk tier (if there is one), dropping the
        oldest unpinned disk chunk when it is full; False if the chunk was dropped instead."""
        self._drop(key)
        if not self.disk_chunks:
            return False
        while len(self.on_disk) >= self.disk_chunks:
            old = next((k for k in self.on_disk if not self.pins.get(k)), None)
            if old is None:
                return False  # every disk chunk is pinned
            del self.on_disk[old]
            plan.disk_drops.append(old)
            self.events.append(BlockRemoved((bytes.fromhex(old),), "DISK"))
        self.on_disk[key] = None
        self.events.append(
            BlockStored((bytes.fromhex(key),), None, (), self.tokens_per_chunk, "DISK")
        )
        return True

    def _unpin(self, key: str) -> None:
        left = self.pins.get(key, 0) - 1
        if left > 0:
            self.pins[key] = left
        else:
            self.pins.pop(key, None)

    def _drop(self, key: str, announce: bool = True) -> None:
        slot = self.slot_of.pop(key)
        self.free_slots.append(slot)
        if key in self.ready:
            self.ready.discard(key)
            self.policy.remove(key)
            if announce:
                self.events.append(BlockRemoved((bytes.fromhex(key),), "CPU"))
