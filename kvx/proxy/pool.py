"""The set of prefill and decode servers, each with its health and load.

Servers can be added and removed while the proxy runs (`ServerPool.add` / `remove`): the
discovery listener (`kvx.proxy.discovery`) calls them when P and D servers announce themselves
or stop doing so. Every method is thread-safe, so a discovery thread may call them too.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvx.proxy.config import normalize_server_url

log = logging.getLogger("kvx.proxy")


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class Health(StrEnum):
    UNKNOWN = "unknown"  # not checked yet: eligible, but /health of the proxy does not count it
    UP = "up"
    DOWN = "down"  # out of rotation until a health check succeeds


@dataclass(eq=False)
class Upstream:
    """One prefill or decode server as the proxy sees it."""

    url: str
    role: Role
    health: Health = Health.UNKNOWN
    outstanding: int = 0
    """Requests sent to it whose answer has not been fully passed on yet."""
    requests: int = 0
    failures: int = 0
    last_error: str | None = None
    """Why the server is down; None while it is not (the fields of /kvx/servers agree)."""
    since: float = field(default_factory=time.time)
    """When `health` last changed (Unix time)."""
    checked_at: float | None = None
    removed: bool = False
    kv_address: str | None = None
    """host:port of its connector's KV listener, when it announced one (discovery)."""
    discovered: bool = False
    """Added by discovery (it leaves when its heartbeats stop), not by the configuration."""

    @property
    def eligible(self) -> bool:
        return not self.removed and self.health is not Health.DOWN

    def snapshot(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "role": str(self.role),
            "health": str(self.health),
            "since": self.since,
            "checked_at": self.checked_at,
            "outstanding": self.outstanding,
            "requests": self.requests,
            "failures": self.failures,
            "last_error": self.last_error,
            "kv_address": self.kv_address,
            "discovered": self.discovered,
        }

    def describe(self) -> str:
        """`http://h:p (down since 12:00:01: connection refused)` for error messages."""
        stamp = time.strftime("%H:%M:%S", time.localtime(self.since))
        why = f": {self.last_error}" if self.health is Health.DOWN and self.last_error else ""
        return f"{self.url} ({self.health} since {stamp}{why})"


class ServerPool:
    """Prefill and decode servers by role, in the order they were added."""

    def __init__(self, prefill: tuple[str, ...] = (), decode: tuple[str, ...] = ()) -> None:
        self._lock = threading.Lock()
        self._servers: dict[Role, list[Upstream]] = {Role.PREFILL: [], Role.DECODE: []}
        for url in prefill:
            self.add(Role.PREFILL, url)
        for url in decode:
            self.add(Role.DECODE, url)

    def add(self, role: Role | str, url: str, kv_address: str | None = None) -> Upstream:
        """Put a server into rotation (health unknown until checked); adding a known server
        returns it, with `kv_address` (if given) updated. ValueError for a bad URL or role."""
        server = self._add(Role(role), normalize_server_url(url), kv_address, None)
        assert server is not None
        return server

    def add_discovered(
        self, role: Role | str, url: str, kv_address: str | None, limit: int
    ) -> Upstream | None:
        """`add` for a server that announced itself: a new one only while fewer than `limit`
        discovered servers are in the pool (else None); a known one is returned as `add`
        does."""
        return self._add(Role(role), normalize_server_url(url), kv_address, limit)

    def _add(
        self, role: Role, url: str, kv_address: str | None, limit: int | None
    ) -> Upstream | None:
        with self._lock:
            for server in self._servers[role]:
                if server.url == url:
                    if kv_address is not None:
                        server.kv_address = kv_address
                    return server
            if limit is not None and self._count_discovered() >= limit:
                return None
            server = Upstream(url, role, kv_address=kv_address, discovered=limit is not None)
            self._servers[role].append(server)
        how = " by discovery" if limit is not None else ""
        kv = f" (kv {kv_address})" if kv_address else ""
        log.info("%s server %s%s added%s", role, url, kv, how)
        return server

    def _count_discovered(self) -> int:
        return sum(s.discovered for servers in self._servers.values() for s in servers)

    def remove(self, role: Role | str, url: str) -> bool:
        """Take a server out of the pool; requests already sent to it finish. False if it was
        not in the pool."""
        role, url = Role(role), normalize_server_url(url)
        with self._lock:
            for server in self._servers[role]:
                if server.url == url:
                    self._servers[role].remove(server)
                    server.removed = True
                    break
            else:
                return False
        log.info("%s server %s removed", role, url)
        return True

    def servers(self, role: Role | None = None) -> list[Upstream]:
        with self._lock:
            if role is not None:
                return list(self._servers[role])
            return [*self._servers[Role.PREFILL], *self._servers[Role.DECODE]]

    def eligible(self, role: Role) -> list[Upstream]:
        return [s for s in self.servers(role) if s.eligible]

    def mark_up(self, server: Upstream) -> None:
        """Health check passed: `last_error` (why it was down) no longer applies."""
        server.last_error = None
        if server.health is not Health.UP:
            if server.health is Health.DOWN:
                log.warning("%s server %s is up again", server.role, server.url)
            server.health, server.since = Health.UP, time.time()

    def mark_down(self, server: Upstream, reason: str) -> None:
        server.last_error = reason
        if server.health is not Health.DOWN:
            log.warning("%s server %s is down: %s", server.role, server.url, reason)
            server.health, server.since = Health.DOWN, time.time()

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        return {str(role): [s.snapshot() for s in self.servers(role)] for role in Role}
