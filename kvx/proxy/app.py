"""The proxy as an ASGI application (Starlette): its routes, request bodies and error answers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvx.proxy.config import ProxyConfig
from kvx.proxy.errors import ProxyError, error_document
from kvx.proxy.forward import Exchange, Forwarder
from kvx.proxy.health import HealthChecker
from kvx.proxy.metrics import MetricsMiddleware, ProxyMetrics
from kvx.proxy.pool import Health, Role, ServerPool
from kvx.proxy.routing import make_router

log = logging.getLogger("kvx.proxy")

CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
"""A client's X-Request-Id the proxy passes on; any other gets a fresh id."""


async def read_json_object(request: Request, limit: int, timeout: float) -> dict[str, Any]:
    """The request's JSON object body, at most `limit` bytes, received within `timeout`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ProxyError(
            413, f"the request body is {declared} bytes; the limit is {limit} (--max-body-bytes)"
        )
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise ProxyError(
                        413, f"the request body exceeds {limit} bytes (--max-body-bytes)"
                    )
    except TimeoutError:
        raise ProxyError(
            408, f"the request body did not arrive within {timeout:g} s (--request-timeout)"
        ) from None
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProxyError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ProxyError(
            400, f"the request body must be a JSON object, not {type(document).__name__}"
        )
    return document


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


def build_app(config: ProxyConfig, pool: ServerPool | None = None) -> Starlette:
    """The proxy for `config`; `pool` (default: one built from the config's servers) is also
    `app.state.pool`, to add or remove servers while it runs."""
    pool = pool if pool is not None else ServerPool(config.prefill, config.decode)
    routers = {role: make_router(config.routing) for role in Role}
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
            try:
                yield
            finally:
                health_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await health_task

    async def completion(request: Request) -> Response:
        try:
            body = await read_json_object(request, config.max_body_bytes, config.request_timeout)
        except ClientDisconnect:
            return Response(status_code=400)
        headers = upstream_headers(request)
        exchange = Exchange(request.url.path, body, headers, headers["x-request-id"])
        forwarder: Forwarder = request.app.state.forwarder
        return await forwarder.complete(exchange)

    async def models(request: Request) -> Response:
        forwarder: Forwarder = request.app.state.forwarder
        return await forwarder.models(upstream_headers(request))

    async def health(request: Request) -> Response:
        counts = {
            str(role): {
                "up": sum(s.health is Health.UP for s in pool.servers(role)),
                "total": len(pool.servers(role)),
            }
            for role in Role
        }
        ready = all(c["up"] > 0 for c in counts.values())
        document = {"status": "ok" if ready else "unavailable", **counts}
        return JSONResponse(document, 200 if ready else 503)

    async def servers(request: Request) -> Response:
        document: dict[str, Any] = {"routing": config.routing, **pool.snapshot()}
        discovery = getattr(request.app.state, "discovery", None)
        if discovery is not None:
            document["discovery"] = {"address": discovery.address, **vars(discovery.counts)}
        return JSONResponse(document)

    async def proxy_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ProxyError)
        return JSONResponse(exc.document(), exc.status)

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
