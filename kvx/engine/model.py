"""A deterministic stand-in for a transformer: no weights, exact checks.

- Each token's K and V are a pure function of (the token prefix up to that position, layer,
  K/V, global head, dim), so any process can compute what a block must contain.
- The next token is a pure function of the KV a step actually *read* from the paged cache.
  Every worker reduces the KV it holds (its TP head shard, its PP layers) to an integer modulo a
  prime; integer sums are exact and order-free, so the total, and the sampled token, do not depend
  on TP, PP or layout, while one wrong element changes it (like a real model's output).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MASK64 = (1 << 64) - 1
SCORE_PRIME = (1 << 31) - 1
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of a 64-bit int."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
    return x ^ (x >> 31)


def prefix_hashes(token_ids: Sequence[int], seed: int = 0) -> list[int]:
    """One 64-bit hash per position, chained over every token up to and including it."""
    return extend_prefix_hashes([], token_ids, seed)


def extend_prefix_hashes(hashes: list[int], token_ids: Sequence[int], seed: int = 0) -> list[int]:
    """`hashes` (those of `token_ids[:len(hashes)]`) extended in place to every position of
    `token_ids`, hashing only the new tokens; returns `hashes`."""
    h = hashes[-1] if hashes else _mix64(seed & MASK64)
    for token in token_ids[len(hashes) :]:
        h = _mix64((h ^ (token * 0x9E3779B97F4A7C15)) & MASK64)
        hashes.append(h)
    return hashes


@dataclass(frozen=True)
class ToyModel:
    """Model dims and the deterministic KV / sampling functions."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    vocab_size: int = 1024
    seed: int = 0
    use_mla: bool = False

    @property
    def kv_parts(self) -> int:
        """2 (K and V) for attention, 1 latent for MLA."""
        return 1 if self.use_mla else 2

    def token_kv(
        self, hashes: Sequence[int], layer: int, heads: range, dtype: torch.dtype
    ) -> torch.Tensor:
        """KV of the given positions for one layer and a range of global heads:
        shape `[n, kv_parts, len(heads), head_size]` (MLA: one head)."""
        if self.use_mla:
            heads = range(1)
        base = torch.tensor([(h >> 11) / float(1 << 53) for h in hashes], dtype=torch.float64)
        kv = torch.arange(self.kv_parts, dtype=torch.float64)
        head = torch.tensor(list(heads), dtype=torch.float64)
        dim = torch.arange(self.head_size, dtype=torch.float64)
        angle = (
            base.view(-1, 1, 1, 1) * 9973.0
            + kv.view(1, -1, 1, 1) * 0.7310
            + head.view(1, 1, -1, 1) * 1.6180
            + dim.view(1, 1, 1, -1) * 0.1234
            + (layer + 1) * 2.7183
        )
        return torch.sin(angle).to(dtype)

    def score(self, kv: torch.Tensor, positions: torch.Tensor, layer: int, heads: range) -> int:
        """Reduce KV read from the cache (`[n, kv_parts, heads, head_size]`) to an int mod P."""
        if self.use_mla:
            heads = range(1)
        bits = kv.contiguous().view(_INT_VIEW[kv.element_size()]).to(torch.int64)
        bits = bits & ((1 << (8 * kv.element_size())) - 1)
        weight = (
            (positions.to(torch.int64).view(-1, 1, 1, 1) + 1) * 1_000_003
            + torch.arange(self.kv_parts).view(1, -1, 1, 1) * 7_919
            + (torch.tensor(list(heads), dtype=torch.int64).view(1, 1, -1, 1) + 1) * 104_729
            + torch.arange(self.head_size).view(1, 1, 1, -1) * 31
            + (layer + 1) * 15_485_863
        ) % SCORE_PRIME
        return int(((bits % SCORE_PRIME) * weight % SCORE_PRIME).sum().item() % SCORE_PRIME)

    def sample(self, total_score: int) -> int:
        """The next token from the sum of every worker's score."""
        return _mix64(total_score % SCORE_PRIME) % self.vocab_size
