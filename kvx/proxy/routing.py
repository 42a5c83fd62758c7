"""Routing policies: which of a role's eligible servers gets the next request."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvx.proxy.pool import Upstream


class Router(Protocol):
    def choose(self, candidates: Sequence[Upstream]) -> Upstream:
        """One of `candidates` (never empty)."""
        ...


class RoundRobin:
    """Each request goes to the next server in turn."""

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Upstream]) -> Upstream:
        server = candidates[self._turn % len(candidates)]
        self._turn += 1
        return server


class LeastOutstanding:
    """The server with the fewest requests in flight; ties are taken in turn."""

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Upstream]) -> Upstream:
        fewest = min(s.outstanding for s in candidates)
        idlest = [s for s in candidates if s.outstanding == fewest]
        server = idlest[self._turn % len(idlest)]
        self._turn += 1
        return server


def make_router(policy: str) -> Router:
    """The router named by --routing (the config has checked the name)."""
    if policy == "least_outstanding":
        return LeastOutstanding()
    return RoundRobin()
