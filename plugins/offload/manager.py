"""The scheduler side's record of what the CPU tier holds: slots, pins, eviction, events.

Matches vLLM's OffloadingManager contract: `lookup` counts leading hits, `prepare_load` pins,
`complete_load` unpins, `prepare_store` reserves slots (evicting unpinned keys) or returns None
when nothing can be stored now, `complete_store(success=False)` forgets the keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvx.plugins.offload.policies import POLICIES

from kvx import BlockRemoved, BlockStored, KVCacheEvent


@dataclass
class StorePlan:
    keys: list[str]
    slots: list[int]
    evicted: list[str] = field(default_factory=list)


class OffloadingManager:
    def __init__(
        self,
        num_slots: int,
        policy: str = "lru",
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
        tokens_per_chunk: int = 0,
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

    def lookup(self, keys: Sequence[str]) -> int:
        """Number of leading keys that are stored and loadable."""
        count = 0
        for key in keys:
            if key not in self.ready:
                break
            count += 1
        return count

    def prepare_load(self, keys: Sequence[str]) -> list[int]:
        """Pin `keys` against eviction and return their slots."""
        for key in keys:
            self.pins[key] = self.pins.get(key, 0) + 1
            self.policy.touch(key)
        return [self.slot_of[k] for k in keys]

    def complete_load(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._unpin(key)

    def prepare_store(self, keys: Sequence[str]) -> StorePlan | None:
        """Slots for the keys worth storing now (already stored, under-offered or in-flight keys
        are left out); None when no slot can be freed."""
        wanted = []
        for key in keys:
            if key in self.slot_of:
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
                self._drop(victim)
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

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def reset(self) -> bool:
        """Forget every unpinned key; False if some are still in use."""
        for key in [k for k in self.slot_of if not self.pins.get(k)]:
            self._drop(key)
        return not self.slot_of

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
