"""One completion request through the proxy: prefill on a P server, then decode on a D server.

P gets the client's request with `max_tokens` 1, streaming off and
`kv_transfer_params.do_remote_decode`; the `kv_transfer_params` P answers with go to D together
with the client's original request, and D's answer (streamed or whole) goes back to the client
byte for byte. This is the exchange vLLM's disaggregated-serving proxies perform.

Retries: a P server that fails is replaced by another (nothing has reached the client yet);
a D server is replaced only when the connection to it could not be made, since a D that got
the request may already have pulled the KV cache from P, and not even then when P was told to
push the KV cache to that D (`decode_address`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from starlette.responses import Response

from kvx import tracing
from kvx.proxy.errors import (
    Attempt,
    ProxyError,
    describe_failure,
    snippet,
    sse_error_event,
)
from kvx.proxy.pool import Role, ServerPool, Upstream
from kvx.proxy.relay import CUT, EventScanner, EventTooLarge, RelayResponse
from kvx.proxy.routing import RouteHint, Router
from kvx.proxy.tokens import prompt_tokens

log = logging.getLogger("kvx.proxy")

PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What P is told: prefill only, and keep the KV cache for a remote decoder to fetch."""

PREFILL_DROPPED_FIELDS = ("stream_options", "min_tokens", "min_completion_tokens")
"""Fields that make no sense for a one-token, non-streamed prefill request."""

MAX_UPSTREAM_BODY_BYTES = 64 * 1024 * 1024
"""The largest answer the proxy holds in memory (P's answers, non-streamed D answers)."""


def peer_addresses(decode: Upstream) -> dict[str, str]:
    """`decode_address`: the KV listener (host:port) of the D serving a request, when D
    announced one (service discovery). A connector where P pushes the KV cache to D (P2P NCCL's
    PUT modes) learns from it where to send it; D finds P in P's own answer."""
    return {"decode_address": decode.kv_address} if decode.kv_address else {}


def prefill_request(
    body: Mapping[str, Any], peers: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The client's request as P gets it (with D's KV address, if known, and the trace
    context when tracing is on)."""
    prefill = {k: v for k, v in body.items() if k not in PREFILL_DROPPED_FIELDS}
    prefill["kv_transfer_params"] = {**PREFILL_KV_TRANSFER_PARAMS, **(peers or {})}
    prefill["stream"] = False
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    return prefill


def decode_request(
    body: Mapping[str, Any], kv_transfer_params: dict[str, Any] | None
) -> dict[str, Any]:
    """The client's request as D gets it: unchanged, plus P's `kv_transfer_params` if any. A
    client's own `kv_transfer_params` never reach D: they would tell D which of P's blocks to
    read (another request's KV)."""
    decode = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if kv_transfer_params:
        decode["kv_transfer_params"] = kv_transfer_params
    return decode


def kv_transfer_params_of(content: bytes) -> dict[str, Any] | None:
    """The `kv_transfer_params` in P's answer; ValueError if the answer is not what vLLM sends."""
    try:
        answer = json.loads(content)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"answered with a body that is not JSON ({exc}): {snippet(content)}"
        ) from None
    if not isinstance(answer, dict):
        raise ValueError(f"answered with JSON that is not an object: {snippet(content)}")
    params = answer.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"answered with kv_transfer_params that is not an object: {params!r:.200}")
    return params


class AnswerTooLarge(Exception):
    pass


async def read_capped(answer: httpx.Response) -> bytes:
    """The whole body of `answer`, refusing more than MAX_UPSTREAM_BODY_BYTES."""
    body = bytearray()
    async for chunk in answer.aiter_raw():
        body += chunk
        if len(body) > MAX_UPSTREAM_BODY_BYTES:
            raise AnswerTooLarge(f"answered with more than {MAX_UPSTREAM_BODY_BYTES} bytes")
    return bytes(body)


@dataclass(frozen=True)
class Exchange:
    """One client request on its way through the proxy."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    """Headers every upstream request of this exchange carries (request id, authorization)."""
    request_id: str

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True


def answer_headers(
    upstream: httpx.Headers, exchange: Exchange, **servers: Upstream
) -> dict[str, str]:
    """Headers for the client: the upstream body's type and encoding, the request id and which
    servers served it (`x-kvx-prefill`, `x-kvx-decode`)."""
    headers = {"content-type": upstream.get("content-type", "application/json")}
    if "content-encoding" in upstream:
        headers["content-encoding"] = upstream["content-encoding"]
    headers["x-request-id"] = exchange.request_id
    for role, server in servers.items():
        headers[f"x-kvx-{role}"] = server.url
    return headers


MAX_FACTS_HEADER_CHARS = 4096
"""P's transfer facts larger than this (as JSON) are not put in a header."""


def prefill_facts_header(kv_transfer_params: Mapping[str, Any] | None) -> dict[str, str]:
    """`x-kvx-prefill-transfer`: P's transfer facts (`kvx_transfer.prefill` of P's answer, as
    compact JSON) for the client; a streamed answer carries no `kv_transfer_params`, so this
    is where a streaming client finds them. Empty when P gave none or too many."""
    legs = (kv_transfer_params or {}).get("kvx_transfer")
    facts = legs.get("prefill") if isinstance(legs, dict) else None
    if not isinstance(facts, dict):
        return {}
    text = json.dumps(facts, separators=(",", ":"), ensure_ascii=True)
    return {"x-kvx-prefill-transfer": text} if len(text) <= MAX_FACTS_HEADER_CHARS else {}


class Forwarder:
    """Sends exchanges to the pool's servers, chosen by one router per role."""

    def __init__(
        self,
        pool: ServerPool,
        client: httpx.AsyncClient,
        routers: Mapping[Role, Router],
        timeout: float,
    ) -> None:
        self.pool, self.client, self.routers, self.timeout = pool, client, routers, timeout

    def _reserve(
        self, role: Role, tried: set[Upstream], hint: RouteHint | None = None
    ) -> Upstream | None:
        """The router's choice among the role's eligible servers not tried yet, counted as
        tried and as busy (`outstanding`) from now on; None if there is none."""
        candidates = [s for s in self.pool.eligible(role) if s not in tried]
        if not candidates:
            return None
        server = self.routers[role].choose(candidates, hint)
        tried.add(server)
        server.outstanding += 1
        return server

    def _unavailable(self, role: Role, attempts: list[Attempt]) -> ProxyError:
        if attempts:
            return ProxyError(
                502, f"every {role} server tried failed; last: {attempts[-1].reason}", attempts
            )
        servers = self.pool.servers(role)
        if not servers:
            return ProxyError(503, f"no {role} server is configured")
        listed = "; ".join(s.describe() for s in servers)
        return ProxyError(503, f"no healthy {role} server: {listed}")

    def _failed(
        self, exchange: Exchange, server: Upstream, reason: str, attempts: list[Attempt]
    ) -> None:
        """Record that `server` did not serve this exchange, and why."""
        server.failures += 1
        attempts.append(Attempt(server.url, str(server.role), reason))
        log.warning(
            "request %s: %s server %s failed: %s",
            exchange.request_id,
            server.role,
            server.url,
            reason,
        )

    def _timed_out(
        self, exchange: Exchange, server: Upstream, attempts: list[Attempt]
    ) -> ProxyError:
        reason = describe_failure(TimeoutError(), self.timeout)
        self._failed(exchange, server, reason, attempts)
        return ProxyError(504, f"{server.role} server {server.url}: {reason}", attempts)

    async def complete(self, exchange: Exchange) -> Response:
        """Prefill, then decode; the client's answer, or ProxyError.

        D is chosen first and counts as busy while P works: no prefill is done for a request
        no D can take, and a connector where P sends the KV cache to D could be told which D.
        With tracing on (`kvx.tracing`) this is the request's root span."""
        attributes = {"kvx.request_id": exchange.request_id, "http.route": exchange.path}
        with tracing.span("kvx.proxy.request", attributes):
            return await self._complete(exchange)

    async def _complete(self, exchange: Exchange) -> Response:
        hint = await self._hint(exchange)
        decode_server = self._reserve(Role.DECODE, set(), hint)
        if decode_server is None:
            raise self._unavailable(Role.DECODE, [])
        decoding = False
        try:
            with tracing.span("kvx.proxy.prefill"):
                prefilled = await self._prefill(exchange, decode_server, hint)
            if isinstance(prefilled, Response):
                return prefilled
            decoding = True
        finally:
            if not decoding:
                decode_server.outstanding -= 1
        kv_transfer_params, prefill_server = prefilled
        with tracing.span("kvx.proxy.decode"):
            return await self._decode(
                exchange, kv_transfer_params, prefill_server, decode_server, hint
            )

    async def _hint(self, exchange: Exchange) -> RouteHint | None:
        """The prompt's tokens, when a router routes by them (`kv_aware`)."""
        if not any(router.wants_tokens for router in self.routers.values()):
            return None
        servers = self.pool.eligible(Role.PREFILL) or self.pool.eligible(Role.DECODE)
        if not servers:
            return None
        server = min(servers, key=lambda s: s.outstanding)
        tokens = await prompt_tokens(
            self.client,
            server,
            exchange.path,
            exchange.body,
            exchange.headers,
            exchange.request_id,
        )
        return None if tokens is None else RouteHint(tokens)

    async def _prefill(
        self, exchange: Exchange, decode_server: Upstream, hint: RouteHint | None = None
    ) -> tuple[dict[str, Any] | None, Upstream] | Response:
        """P's `kv_transfer_params` and which P gave them; or P's own answer when it refused
        the request (4xx: the client's request is at fault, so it gets P's reason)."""
        attempts: list[Attempt] = []
        tried: set[Upstream] = set()
        while (server := self._reserve(Role.PREFILL, tried, hint)) is not None:
            body = prefill_request(
                exchange.body, {**peer_addresses(decode_server), **tracing.carrier()}
            )
            server.requests += 1
            try:
                async with (
                    asyncio.timeout(self.timeout),
                    self.client.stream(
                        "POST", server.url + exchange.path, json=body, headers=exchange.headers
                    ) as answer,
                ):
                    content = await read_capped(answer)
            except (httpx.TimeoutException, TimeoutError):
                raise self._timed_out(exchange, server, attempts) from None
            except (httpx.HTTPError, AnswerTooLarge) as exc:
                reason = describe_failure(exc, self.timeout)
                self._failed(exchange, server, reason, attempts)
                if isinstance(exc, httpx.ConnectError):
                    self.pool.mark_down(server, reason)
                continue
            finally:
                server.outstanding -= 1
            if answer.status_code >= 500:
                reason = f"answered HTTP {answer.status_code}: {snippet(content)}"
                self._failed(exchange, server, reason, attempts)
                continue
            if answer.status_code != 200:
                headers = answer_headers(answer.headers, exchange, prefill=server)
                return Response(content, answer.status_code, headers)
            try:
                return kv_transfer_params_of(content), server
            except ValueError as exc:
                self._failed(exchange, server, str(exc), attempts)
        raise self._unavailable(Role.PREFILL, attempts)

    async def _decode(
        self,
        exchange: Exchange,
        kv_transfer_params: dict[str, Any] | None,
        prefill_server: Upstream,
        decode_server: Upstream,
        hint: RouteHint | None = None,
    ) -> Response:
        """D's answer to the request; `decode_server` (already counted busy) is asked first,
        and replaced only if it cannot be connected to."""
        body = decode_request(
            exchange.body, {**(kv_transfer_params or {}), **tracing.carrier()} or None
        )
        attempts: list[Attempt] = []
        tried = {decode_server}
        next_server: Upstream | None = decode_server
        while next_server is not None:
            server = next_server
            server.requests += 1
            relaying = False
            try:
                request = self.client.build_request(
                    "POST", server.url + exchange.path, json=body, headers=exchange.headers
                )
                async with asyncio.timeout(self.timeout):
                    answer = await self.client.send(request, stream=True)
                    headers = answer_headers(
                        answer.headers, exchange, prefill=prefill_server, decode=server
                    )
                    headers.update(prefill_facts_header(kv_transfer_params))
                    if not exchange.stream or answer.status_code != 200:
                        try:
                            content = await read_capped(answer)
                        finally:
                            await answer.aclose()
                        if answer.status_code >= 500:
                            reason = f"answered HTTP {answer.status_code}: {snippet(content)}"
                            self._failed(exchange, server, reason, attempts)
                        return Response(content, answer.status_code, headers)
                relaying = True
                return RelayResponse(
                    self._relay(answer, server, exchange), answer.status_code, headers
                )
            except httpx.ConnectError as exc:
                # The request never reached this server: another may take it, unless P was
                # told to send the KV cache to this one (decode_address).
                reason = describe_failure(exc, self.timeout)
                self._failed(exchange, server, reason, attempts)
                self.pool.mark_down(server, reason)
                if server is decode_server and server.kv_address:
                    raise ProxyError(
                        502,
                        f"decode server {server.url}: {reason}; P sent this request's KV cache "
                        f"to it ({server.kv_address}), so no other decode server can take it",
                        attempts,
                    ) from None
            except (httpx.TimeoutException, TimeoutError):
                raise self._timed_out(exchange, server, attempts) from None
            except (httpx.HTTPError, AnswerTooLarge) as exc:
                reason = describe_failure(exc, self.timeout)
                self._failed(exchange, server, reason, attempts)
                raise ProxyError(502, f"decode server {server.url}: {reason}", attempts) from None
            finally:
                if not relaying:
                    server.outstanding -= 1
            next_server = self._reserve(Role.DECODE, tried, hint)
        raise self._unavailable(Role.DECODE, attempts)

    async def _relay(
        self, answer: httpx.Response, server: Upstream, exchange: Exchange
    ) -> AsyncIterator[bytes]:
        """D's streamed answer, chunk by chunk as it arrives. If D reports an error in the
        stream or the stream breaks, the client gets one error event, no `[DONE]`, and a cut
        connection (`kvx.proxy.relay`): every client counts the request as failed."""
        events = answer.headers.get("content-type", "").startswith("text/event-stream")
        scanner = EventScanner()
        failure: str | None = None
        try:
            async for chunk in answer.aiter_raw():
                if events:
                    chunk, said = scanner.feed(chunk)
                    if said is not None:
                        failure = f"sent an error event: {said}"
                if chunk:
                    yield chunk
                if failure is not None:
                    break
        except (httpx.HTTPError, EventTooLarge) as exc:
            failure = describe_failure(exc, self.timeout)
            if events:
                status = 504 if isinstance(exc, httpx.TimeoutException) else 502
                message = f"decode server {server.url}: {failure}"
                yield scanner.separator() + sse_error_event(status, message)
        finally:
            server.outstanding -= 1
            with anyio.CancelScope(shield=True):
                await answer.aclose()
        if failure is not None:
            server.failures += 1
            log.warning(
                "request %s: decode stream from %s failed: %s; the client's stream is cut",
                exchange.request_id,
                server.url,
                failure,
            )
            yield CUT

    async def models(self, headers: dict[str, str]) -> Response:
        """GET /v1/models of the first healthy server that answers (decode servers first)."""
        attempts: list[Attempt] = []
        for server in [*self.pool.eligible(Role.DECODE), *self.pool.eligible(Role.PREFILL)]:
            try:
                async with (
                    asyncio.timeout(self.timeout),
                    self.client.stream("GET", f"{server.url}/v1/models", headers=headers) as answer,
                ):
                    content = await read_capped(answer)
            except (httpx.HTTPError, AnswerTooLarge, TimeoutError) as exc:
                attempts.append(
                    Attempt(server.url, str(server.role), describe_failure(exc, self.timeout))
                )
                continue
            if answer.status_code == 200:
                return Response(content, 200, {"content-type": "application/json"})
            reason = f"answered HTTP {answer.status_code}: {snippet(content)}"
            attempts.append(Attempt(server.url, str(server.role), reason))
        if attempts:
            raise ProxyError(502, "no server answered GET /v1/models", attempts)
        raise self._unavailable(Role.DECODE, [])
