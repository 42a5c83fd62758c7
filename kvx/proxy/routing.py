"""Routing policies: which of a role's eligible servers gets the next request."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvx.proxy.pool import Upstream
from kvx.proxy.prefix_index import PrefixIndex, chain_keys

MAX_PROMPT_BLOCKS = 16384
"""The most blocks of a prompt KV-aware routing looks up."""
KV_AWARE_EXTRA_LOAD = 4
"""KV-aware routing passes over a server holding the prefix when it has more than this many
requests in flight beyond the least busy candidate (a hot prefix must not pile up on one)."""


class RouteHint:
    """What a request tells routers about itself: its prompt's token ids."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = tokens
        self._keys: dict[int, list[bytes]] = {}

    def keys(self, block_size: int) -> list[bytes]:
        """The prompt's block keys at `block_size` (computed once per size)."""
        if block_size not in self._keys:
            self._keys[block_size] = chain_keys(self.tokens, block_size, MAX_PROMPT_BLOCKS)
        return self._keys[block_size]


class Router(Protocol):
    wants_tokens: bool
    """Whether `choose` uses a RouteHint (the proxy then tokenizes the prompt)."""

    def choose(self, candidates: Sequence[Upstream], hint: RouteHint | None = None) -> Upstream:
        """One of `candidates` (never empty)."""
        ...


class RoundRobin:
    """Each request goes to the next server in turn."""

    wants_tokens = False

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Upstream], hint: RouteHint | None = None) -> Upstream:
        server = candidates[self._turn % len(candidates)]
        self._turn += 1
        return server


class LeastOutstanding:
    """The server with the fewest requests in flight; ties are taken in turn."""

    wants_tokens = False

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Upstream], hint: RouteHint | None = None) -> Upstream:
        fewest = min(s.outstanding for s in candidates)
        idlest = [s for s in candidates if s.outstanding == fewest]
        server = idlest[self._turn % len(idlest)]
        self._turn += 1
        return server


class KvAware:
    """The server whose KV cache holds the longest prefix of the prompt (by the engines' KV
    events, `PrefixIndex`), unless it is much busier than the others; ties, prompts nobody
    holds and requests without a hint go by `LeastOutstanding`."""

    wants_tokens = True

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.fallback = LeastOutstanding()
        self.routed = 0
        """Requests sent by a held prefix (the rest went by load)."""

    def matched(self, server: Upstream, hint: RouteHint) -> int:
        block_size = self.index.block_size(server.url)
        if block_size is None:
            return 0
        return self.index.matched(server.url, hint.keys(block_size))

    def choose(self, candidates: Sequence[Upstream], hint: RouteHint | None = None) -> Upstream:
        if hint is not None:
            allowed = min(s.outstanding for s in candidates) + KV_AWARE_EXTRA_LOAD
            scored = [(self.matched(s, hint), s) for s in candidates if s.outstanding <= allowed]
            best = max(n for n, _ in scored)
            if best > 0:
                self.routed += 1
                return self.fallback.choose([s for n, s in scored if n == best])
        return self.fallback.choose(candidates)


def make_router(policy: str, index: PrefixIndex | None = None) -> Router:
    """The router named by --routing (the config has checked the name); `kv_aware` needs the
    index its KV events fill."""
    if policy == "least_outstanding":
        return LeastOutstanding()
    if policy == "kv_aware":
        assert index is not None
        return KvAware(index)
    return RoundRobin()
