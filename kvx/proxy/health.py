"""Health checks: GET /health on every server, every interval; a failed check takes the server
out of rotation and a passing one puts it back. And the proxy's own /health, from the results."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from kvx.proxy.errors import describe_failure
from kvx.proxy.pool import Health, Role, ServerPool, Upstream


class HealthChecker:
    def __init__(
        self, pool: ServerPool, client: httpx.AsyncClient, interval: float, timeout: float
    ) -> None:
        self.pool, self.client = pool, client
        self.interval, self.timeout = interval, timeout

    async def run(self) -> None:
        """Check every server now, then again each `interval` after the previous round."""
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(s) for s in self.pool.servers()))

    async def check(self, server: Upstream) -> None:
        reason: str | None = None
        try:
            async with (
                asyncio.timeout(self.timeout),
                self.client.stream("GET", f"{server.url}/health", timeout=self.timeout) as answer,
            ):
                if answer.status_code != 200:
                    reason = f"GET /health answered HTTP {answer.status_code}"
        except (httpx.TimeoutException, TimeoutError):
            reason = f"GET /health: no answer within {self.timeout:g} s (--health-timeout)"
        except httpx.HTTPError as exc:
            reason = f"GET /health: {describe_failure(exc, self.timeout)}"
        if reason is None:
            self.pool.mark_up(server)
        else:
            self.pool.mark_down(server, reason)
        server.checked_at = time.time()


def health_document(pool: ServerPool) -> tuple[dict[str, Any], int]:
    """The proxy's /health and its status code: `ok` (200) when every server passed its last
    check; `degraded` (200: the proxy still serves, with less capacity) when each role has a
    server up but some server is down, listed under `down`; `unavailable` (503) when a role
    has no server up."""
    counts: dict[str, Any] = {}
    down: list[dict[str, Any]] = []
    for role in Role:
        servers = pool.servers(role)
        counts[str(role)] = {
            "up": sum(s.health is Health.UP for s in servers),
            "total": len(servers),
        }
        down += [
            {"role": str(role), "url": s.url, "last_error": s.last_error}
            for s in servers
            if s.health is Health.DOWN
        ]
    if not all(c["up"] > 0 for c in counts.values()):
        status, code = "unavailable", 503
    else:
        status, code = ("degraded" if down else "ok"), 200
    document: dict[str, Any] = {"status": status, **counts}
    if down:
        document["down"] = down
    return document, code
