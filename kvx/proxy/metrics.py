"""`kvx proxy`'s Prometheus metrics (GET /metrics): what clients asked and got, how long each
leg to P and D took, which upstream servers fail and which are up.

Three sources, so the forwarding code needs no hooks: an ASGI middleware sees every client
request (route, status, time to the first streamed byte, duration); a wrapper around the
HTTP client's transport times every completion sent to a P or D server (until its answer is
fully read); a collector reads the server pool's own counters and health at scrape time."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import httpx
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvx.proxy.pool import Health, ServerPool

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/kvx/servers")
"""Routes counted by name; any other path counts as `other` (label values stay bounded)."""
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ProxyMetrics:
    """The proxy's registry (its own, not the process-wide one) and its series."""

    def __init__(self, pool: ServerPool) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvx_proxy_requests",
            "Client requests answered by the proxy, by route and HTTP status.",
            ["route", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "kvx_proxy_request_duration_seconds",
            "Time from a client request's arrival to the last byte of its answer.",
            ["route"],
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvx_proxy_time_to_first_token_seconds",
            "Time from a streamed completion's arrival to its first body bytes (the first "
            "token as the client sees it).",
            ["route"],
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.upstream = Histogram(
            "kvx_proxy_upstream_duration_seconds",
            "One leg of a completion: from sending it to a P (role=prefill) or D "
            "(role=decode) server to the last byte of its answer.",
            ["role", "server"],
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(PoolCollector(pool))
        self.pool = pool

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    def transport(self, inner: httpx.AsyncBaseTransport) -> TimedTransport:
        """`inner`, timing the completions sent through it to the pool's servers."""
        return TimedTransport(inner, self)


def route_of(path: str) -> str:
    return path if path in ROUTES else "other"


class MetricsMiddleware:
    """Counts and times every HTTP request the proxy answers."""

    def __init__(self, app: ASGIApp, metrics: ProxyMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route, start = route_of(scope["path"]), time.perf_counter()
        status, streamed, first = 500, False, True

        async def timed_send(message: Message) -> None:
            nonlocal status, streamed, first
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = dict(message.get("headers", []))
                streamed = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and message.get("body") and first:
                first = False
                if streamed and status == 200:
                    self.metrics.ttft.labels(route).observe(time.perf_counter() - start)
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.duration.labels(route).observe(time.perf_counter() - start)


class TimedTransport(httpx.AsyncBaseTransport):
    """Times POSTs to the pool's servers until their answers are read or closed."""

    def __init__(self, inner: httpx.AsyncBaseTransport, metrics: ProxyMetrics) -> None:
        self.inner, self.metrics = inner, metrics

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        start = time.perf_counter()
        response = await self.inner.handle_async_request(request)
        if request.method != "POST":
            return response
        origin = f"{request.url.scheme}://{request.url.netloc.decode('ascii')}"
        server = next((s for s in self.metrics.pool.servers() if s.url == origin), None)
        if server is None:
            return response
        histogram = self.metrics.upstream.labels(str(server.role), server.url)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _TimedStream(
            response.stream, lambda: histogram.observe(time.perf_counter() - start)
        )
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


class _TimedStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, done: Any) -> None:
        self.inner, self.done, self.closed = inner, done, False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.inner:
            yield chunk

    async def aclose(self) -> None:
        try:
            await self.inner.aclose()
        finally:
            if not self.closed:
                self.closed = True
                self.done()


class PoolCollector(Collector):
    """The pool's servers at scrape time: up or not, requests sent, failures, in flight."""

    def __init__(self, pool: ServerPool) -> None:
        self.pool = pool

    def collect(self) -> Iterable[Metric]:
        labels = ["role", "server"]
        up = GaugeMetricFamily(
            "kvx_proxy_server_up",
            "1 if the server's last health check succeeded, else 0 (down or not checked yet).",
            labels=labels,
        )
        outstanding = GaugeMetricFamily(
            "kvx_proxy_server_outstanding_requests",
            "Requests sent to the server whose answer has not been fully passed on yet.",
            labels=labels,
        )
        sent = CounterMetricFamily(
            "kvx_proxy_upstream_requests",
            "Requests the proxy sent to the server.",
            labels=labels,
        )
        errors = CounterMetricFamily(
            "kvx_proxy_upstream_errors",
            "Requests the server did not serve: unreachable, timed out, 5xx or a broken answer.",
            labels=labels,
        )
        for server in self.pool.servers():
            values = [str(server.role), server.url]
            up.add_metric(values, 1.0 if server.health is Health.UP else 0.0)
            outstanding.add_metric(values, server.outstanding)
            sent.add_metric(values, server.requests)
            errors.add_metric(values, server.failures)
        return [up, outstanding, sent, errors]
