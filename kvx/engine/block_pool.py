"""The reference engine's block pool: reference counts, an LRU free queue and prefix caching.

A full block is cached under the chained hash of its tokens (and every token before it). A freed
block keeps its hash and can be hit again until it is reused for something else; eviction takes
the least recently freed block first, like vLLM's free-block queue.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Sequence

from kvx.contract.types import NULL_BLOCK


def block_hashes(token_ids: Sequence[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """Chained hashes of every *full* block of `token_ids`."""
    hashes = []
    prev = parent
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        chunk = token_ids[start : start + block_size]
        digest = hashlib.sha256(
            prev + b"".join(t.to_bytes(8, "little", signed=True) for t in chunk)
        ).digest()
        hashes.append(digest)
        prev = digest
    return hashes


class BlockPool:
    """Fixed set of block ids handed to requests.

    `ref_cnt[b]` counts the requests using block `b`; a block with count 0 sits in the free queue
    (oldest first) and may still carry a cached hash. With `shuffle_seed` the free queue starts
    in a random order, as it is in a long-running engine, so a request's blocks are scattered
    (a connector that assumes them contiguous is caught).
    """

    def __init__(
        self, num_blocks: int, enable_prefix_caching: bool = True, shuffle_seed: int | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        order = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(order)
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in order)
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of `hashes` (not yet referenced)."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on (cached) blocks, pulling them out of the free queue."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                self._free.pop(b, None)
            self.ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks (evicting cached ones, oldest first); raise if too few are free."""
        if n > len(self._free):
            raise MemoryError(f"need {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._uncache(block)
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block (`NULL_BLOCK` entries are skipped); blocks reaching 0
        join the free queue's tail.

        Blocks are queued tail-first so a request's later blocks are evicted before its prefix.
        """
        for b in reversed(blocks):
            if b == NULL_BLOCK:  # a table entry outside a sliding window: no block
                continue
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than referenced")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free[b] = None

    def cache(self, block: int, block_hash: bytes) -> None:
        """Record that `block` holds the full block with `block_hash`."""
        if not self.enable_prefix_caching or block == NULL_BLOCK or block in self._hash_of:
            return
        if block_hash in self._block_of:  # another block already holds it: keep the first
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def evict(self, blocks: Sequence[int]) -> None:
        """Forget the cached hash of `blocks` (their content is wrong or about to be)."""
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            self._uncache(b)

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def _uncache(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            self._block_of.pop(h, None)
