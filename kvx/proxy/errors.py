"""Errors the proxy answers with: JSON naming which server failed and why."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx

ERROR_TYPES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    500: "internal_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}


@dataclass(frozen=True)
class Attempt:
    """One server tried for a request, and why it did not serve it."""

    server: str
    role: str
    reason: str


def error_document(status: int, message: str, attempts: Sequence[Attempt] = ()) -> dict[str, Any]:
    """The body of an error answer, in the OpenAI error shape plus the servers tried."""
    error: dict[str, Any] = {
        "message": message,
        "type": ERROR_TYPES.get(status, "error"),
        "code": status,
    }
    if attempts:
        error["attempts"] = [asdict(a) for a in attempts]
    return {"error": error}


class ProxyError(Exception):
    """Ends a request with `status` and a JSON error body."""

    def __init__(self, status: int, message: str, attempts: Sequence[Attempt] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.attempts = list(attempts)

    def document(self) -> dict[str, Any]:
        return error_document(self.status, self.message, self.attempts)


def sse_error_event(status: int, message: str) -> bytes:
    """An error as one server-sent event, for a stream that already began."""
    return b"data: " + json.dumps(error_document(status, message)).encode() + b"\n\n"


def describe_failure(exc: BaseException, timeout: float) -> str:
    """A short reason for a failed exchange with an upstream server."""
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return f"no answer within {timeout:g} s (--request-timeout)"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect: {exc or 'connection refused'}"
    if isinstance(exc, httpx.RemoteProtocolError):
        return f"closed the connection mid-answer: {exc}"
    if isinstance(exc, httpx.HTTPError):
        return f"{type(exc).__name__}: {exc or 'connection lost'}"
    return f"{type(exc).__name__}: {exc}"


def snippet(content: bytes, limit: int = 300) -> str:
    """The start of an upstream body for an error message."""
    text = content[:limit].decode("utf-8", "replace").strip()
    return text + ("..." if len(content) > limit else "")
