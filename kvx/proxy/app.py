"""The proxy as an ASGI application (Starlette): its routes, request bodies and error answers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvx.proxy.bodies import parse_body
from kvx.proxy.config import BODY_COPIES, ProxyConfig
from kvx.proxy.errors import ProxyError, error_document
from kvx.proxy.forward import Exchange, Forwarder
from kvx.proxy.health import HealthChecker, health_document
from kvx.proxy.kv_events import EventSource, KvEventListener
from kvx.proxy.metrics import MetricsMiddleware, ProxyMetrics
from kvx.proxy.pool import Role, ServerPool
from kvx.proxy.prefix_index import PrefixIndex
from kvx.proxy.routing import KvAware, Router, make_router

log = logging.getLogger("kvx.proxy")

CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
"""A client's X-Request-Id the proxy passes on; any other gets a fresh id."""


class BodyBudget:
    """Memory request bodies hold at once, over all requests (--max-body-memory): each body
    counts BODY_COPIES times its size."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def take(self, n: int) -> None:
        if self.used + n * BODY_COPIES > self.limit:
            raise ProxyError(
                503,
                f"the proxy holds {self.used} bytes for request bodies; a {n}-byte body "
                f"({BODY_COPIES}x that held) would pass --max-body-memory {self.limit}; "
                "retry later",
            )
        self.used += n * BODY_COPIES

    def give(self, n: int) -> None:
        self.used -= n * BODY_COPIES


async def read_json_object(
    request: Request, limit: int, timeout: float, budget: BodyBudget
) -> tuple[dict[str, Any], int]:
    """The request's JSON object body, at most `limit` bytes, received within `timeout`, and
    the bytes of `budget` it took (the caller gives them back). A declared length is
    reserved before any byte is read; a chunked body as it arrives."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ProxyError(
            413, f"the request body is {declared} bytes; the limit is {limit} (--max-body-bytes)"
        )
    reserved = int(declared) if declared.isdigit() else 0
    try:
        budget.take(reserved)
    except ProxyError:
        await _discard_body(request, limit, timeout)  # so the client reads the 503
        raise
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise ProxyError(
                        413, f"the request body exceeds {limit} bytes (--max-body-bytes)"
                    )
                if len(body) > reserved:
                    budget.take(len(body) - reserved)
                    reserved = len(body)
        return parse_body(body), reserved
    except TimeoutError:
        budget.give(reserved)
        raise ProxyError(
            408, f"the request body did not arrive within {timeout:g} s (--body-timeout)"
        ) from None
    except BaseException:
        budget.give(reserved)
        raise


async def _discard_body(request: Request, limit: int, timeout: float) -> None:
    """Read and drop a body the proxy will not serve (at most `limit` bytes, `timeout` s)."""
    seen = 0
    with contextlib.suppress(TimeoutError, ClientDisconnect):
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                seen += len(chunk)
                if seen > limit:
                    return


async def _until_disconnected(request: Request) -> None:
    """Returns once the client is gone (its body was read: nothing else may arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(request: Request, work: Awaitable[Response]) -> Response | None:
    """`work`'s answer; or None once the client disconnected first, `work` being cancelled
    (its upstream requests closed, so P and D stop working for nobody)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


def upstream_headers(request: Request) -> dict[str, str]:
    """What every upstream request of this client request carries: a request id (the client's
    X-Request-Id if it is a plain token, else a fresh one) and the client's Authorization."""
    given = request.headers.get("x-request-id", "")
    headers = {
        "x-request-id": given if CLIENT_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex,
        "accept-encoding": "identity",
    }
    if "authorization" in request.headers:
        headers["authorization"] = request.headers["authorization"]
    return headers


def kv_index_snapshot(
    pool: ServerPool, index: PrefixIndex, listener: KvEventListener, routers: dict[Role, Router]
) -> dict[str, Any]:
    """What KV-aware routing knows: blocks indexed per server, event and index counters, and
    requests routed by a held prefix per role (the rest went by load)."""
    return {
        "blocks": {s.url: index.blocks(s.url) for s in pool.servers()},
        "events": vars(listener.counts),
        "index": vars(index.counts),
        "routed_by_prefix": {
            str(role): r.routed for role, r in routers.items() if isinstance(r, KvAware)
        },
    }


def build_app(config: ProxyConfig, pool: ServerPool | None = None) -> Starlette:
    """The proxy for `config`; `pool` (default: one built from the config's servers) is also
    `app.state.pool`, to add or remove servers while it runs."""
    pool = pool if pool is not None else ServerPool(config.prefill, config.decode)
    index = PrefixIndex(config.kv_index_blocks)
    routers = {role: make_router(config.routing, index) for role in Role}
    sources = tuple(EventSource(url, endpoint) for url, endpoint in config.kv_event_sources())
    events: list[KvEventListener] = []
    metrics = ProxyMetrics(pool)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(
            timeout=config.request_timeout,
            trust_env=False,  # never route to P and D through an HTTP(S)_PROXY of the env
            follow_redirects=False,
            # the connection pool (and its limits) inside the transport that times each leg
            transport=metrics.transport(httpx.AsyncHTTPTransport(limits=limits, trust_env=False)),
        ) as client:
            app.state.forwarder = Forwarder(pool, client, routers, config.request_timeout)
            checker = HealthChecker(pool, client, config.health_interval, config.health_timeout)
            health_task = asyncio.create_task(checker.run(), name="kvx-proxy-health")
            if sources:
                events.append(KvEventListener(sources, index).start())
            try:
                yield
            finally:
                for listener in events:
                    listener.stop()
                events.clear()
                health_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await health_task

    budget = BodyBudget(config.max_body_memory)
    serving = [0]

    async def completion(request: Request) -> Response:
        if serving[0] >= config.max_concurrent_requests:
            raise ProxyError(
                503,
                f"the proxy is serving {serving[0]} requests (--max-concurrent-requests); "
                "retry later",
            )
        serving[0] += 1
        try:
            return await _completion(request)
        finally:
            serving[0] -= 1

    async def _completion(request: Request) -> Response:
        try:
            body, held = await read_json_object(
                request, config.max_body_bytes, config.body_timeout, budget
            )
        except ClientDisconnect:
            return Response(status_code=400)
        try:
            headers = upstream_headers(request)
            exchange = Exchange(request.url.path, body, headers, headers["x-request-id"])
            del body
            forwarder: Forwarder = request.app.state.forwarder
            answer = await unless_client_leaves(request, forwarder.complete(exchange))
        finally:
            budget.give(held)
        if answer is None:
            log.info(
                "request %s: the client left; its upstream work is cancelled", exchange.request_id
            )
            return Response(status_code=499)
        return answer

    async def models(request: Request) -> Response:
        forwarder: Forwarder = request.app.state.forwarder
        return await forwarder.models(upstream_headers(request))

    async def health(request: Request) -> Response:
        return JSONResponse(*health_document(pool))

    async def servers(request: Request) -> Response:
        document: dict[str, Any] = {"routing": config.routing, **pool.snapshot()}
        if events:
            document["kv_index"] = kv_index_snapshot(pool, index, events[0], routers)
        discovery = getattr(request.app.state, "discovery", None)
        if discovery is not None:
            document["discovery"] = {"address": discovery.address, **vars(discovery.counts)}
        return JSONResponse(document)

    async def proxy_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ProxyError)
        headers = {"retry-after": "1"} if exc.status == 503 else None
        return JSONResponse(exc.document(), exc.status, headers=headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse(
            error_document(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"),
            exc.status_code,
            headers=exc.headers,
        )

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(
            error_document(500, f"internal error in kvx proxy: {type(exc).__name__}: {exc}"), 500
        )

    app = Starlette(
        routes=[
            Route("/v1/completions", completion, methods=["POST"]),
            Route("/v1/chat/completions", completion, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/kvx/servers", servers, methods=["GET"]),
            Route("/metrics", metrics.endpoint, methods=["GET"]),
        ],
        middleware=[Middleware(MetricsMiddleware, metrics=metrics)],
        exception_handlers={
            ProxyError: proxy_error,
            HTTPException: http_error,
            Exception: internal_error,
        },
        lifespan=lifespan,
    )
    app.state.pool = pool
    return app
