"""`TopologyError`: a parallel layout or pair of engines that cannot work, and why."""

from __future__ import annotations


class TopologyError(ValueError):
    """A TP/PP/block-size combination was rejected; the message names the field, the value and
    what would work."""


def divisors(n: int) -> list[int]:
    """Every divisor of `n`, ascending (for "what would work" hints)."""
    return [d for d in range(1, n + 1) if n % d == 0]
