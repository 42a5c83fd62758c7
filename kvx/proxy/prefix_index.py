"""Which server holds which prompt prefix in its KV cache, from the engines' KV events.

An engine reports each block it stores (its hash, its parent's hash and its tokens) and each
block it drops. Engines hash blocks with per-process seeds, so the index keys a block by its
own chain hash of the tokens (`chain_keys`), the same for every engine: the key of a block
covers every token from the prompt's start to the block's end. A request's prompt, cut into
blocks of the engine's block size, then matches a server for as many leading keys as it holds.

Bounded: at most `max_blocks` blocks per server (the least recently stored go first), and a
block whose parent the index does not know (an event was lost, or the parent was evicted) is
not indexed. The index only steers routing: a stale or missing entry makes a worse route,
never a wrong answer.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

ROOT = b"kvx-prefix-root"
"""The parent key of a prompt's first block."""


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block with `tokens` following the prefix keyed `parent`."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def chain_keys(tokens: Sequence[int], block_size: int, limit: int) -> list[bytes]:
    """The keys of the full blocks of `tokens` (at most `limit` blocks)."""
    keys: list[bytes] = []
    parent = ROOT
    for start in range(0, min(len(tokens) // block_size, limit) * block_size, block_size):
        parent = block_key(parent, tokens[start : start + block_size])
        keys.append(parent)
    return keys


@dataclass
class ServerBlocks:
    """One server's indexed blocks."""

    block_size: int | None = None
    by_hash: OrderedDict[Hashable, bytes] = field(default_factory=OrderedDict)
    """The engine's block hash -> the index's key, least recently stored first."""
    held: dict[bytes, int] = field(default_factory=dict)
    """Key -> how many of the engine's blocks have it (a block may be stored twice)."""

    def drop(self, engine_hash: Hashable) -> None:
        key = self.by_hash.pop(engine_hash, None)
        if key is None:
            return
        if self.held[key] <= 1:
            del self.held[key]
        else:
            self.held[key] -= 1


@dataclass
class IndexCounts:
    stored: int = 0
    removed: int = 0
    orphaned: int = 0
    """Blocks not indexed because their parent was unknown."""
    evicted: int = 0
    cleared: int = 0


class PrefixIndex:
    """Per server (by URL), the prefixes its KV cache holds. Thread-safe."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.counts = IndexCounts()
        self._lock = threading.Lock()
        self._servers: dict[str, ServerBlocks] = {}

    def stored(
        self,
        server: str,
        block_hashes: Sequence[Hashable],
        parent_hash: Hashable | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        """A BlockStored event: blocks `block_hashes` in a chain after `parent_hash` (None: at
        the prompt's start), holding `token_ids` (`block_size` per block)."""
        with self._lock:
            blocks = self._servers.setdefault(server, ServerBlocks())
            if blocks.block_size != block_size:
                blocks.by_hash.clear()  # keys of another block size can never match
                blocks.held.clear()
                blocks.block_size = block_size
            if parent_hash is None:
                parent: bytes | None = ROOT
            else:
                parent = blocks.by_hash.get(parent_hash)
            if parent is None:
                self.counts.orphaned += len(block_hashes)
                return
            for i, engine_hash in enumerate(block_hashes):
                parent = block_key(parent, token_ids[i * block_size : (i + 1) * block_size])
                blocks.drop(engine_hash)
                blocks.by_hash[engine_hash] = parent
                blocks.held[parent] = blocks.held.get(parent, 0) + 1
                self.counts.stored += 1
            while len(blocks.by_hash) > self.max_blocks:
                blocks.drop(next(iter(blocks.by_hash)))
                self.counts.evicted += 1

    def removed(self, server: str, block_hashes: Sequence[Hashable]) -> None:
        with self._lock:
            blocks = self._servers.get(server)
            if blocks is None:
                return
            for engine_hash in block_hashes:
                if engine_hash in blocks.by_hash:
                    blocks.drop(engine_hash)
                    self.counts.removed += 1

    def cleared(self, server: str) -> None:
        """The server dropped every block (AllBlocksCleared, a restart, lost events)."""
        with self._lock:
            if self._servers.pop(server, None) is not None:
                self.counts.cleared += 1

    def block_size(self, server: str) -> int | None:
        with self._lock:
            blocks = self._servers.get(server)
            return None if blocks is None else blocks.block_size

    def blocks(self, server: str) -> int:
        with self._lock:
            blocks = self._servers.get(server)
            return 0 if blocks is None else len(blocks.by_hash)

    def matched(self, server: str, keys: Sequence[bytes]) -> int:
        """How many of `keys` (a prompt's chain, at this server's block size) the server holds
        from the first on."""
        with self._lock:
            blocks = self._servers.get(server)
            if blocks is None:
                return 0
            n = 0
            for key in keys:
                if key not in blocks.held:
                    break
                n += 1
            return n
