"""Client connections the proxy holds, bounded: a client must send its request headers within
a deadline, and past `max_connections` open connections the one waiting longest for its
headers is closed to make room (a connection with no such idler gets a 503 and is closed).

So a crowd of connections dribbling their headers (slowloris) neither holds the proxy's
descriptors for long nor locks out clients that send a request at once. Built on uvicorn's h11
protocol: the deadline runs from the connection (or the end of the previous answer on a
kept-alive one) until the request's headers are parsed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvx.proxy.errors import error_document

log = logging.getLogger("kvx.proxy")


def _refusal(message: str) -> bytes:
    body = json.dumps(error_document(503, message)).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a cap on open connections; a
    subclass made by `guarded_protocol` carries the settings and the shared waiting list."""

    header_timeout: float = 10.0
    max_connections: int = 1024
    waiting: OrderedDict[GuardedH11Protocol, None]
    """Connections waiting for request headers, the longest waiting first."""
    evicted: list[int]

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            if self.waiting:
                oldest = next(iter(self.waiting))
                oldest._close_waiting()
                self.evicted[0] += 1
            else:
                transport.write(
                    _refusal(
                        f"the proxy holds {self.max_connections} connections, all busy "
                        "(--max-connections); retry later"
                    )
                )
                transport.close()
                return
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_arrived()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._headers_arrived()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._await_headers()  # a kept-alive connection: the next request's deadline

    def _await_headers(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._close_waiting)
            self.waiting[self] = None

    def _headers_arrived(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
            self.waiting.pop(self, None)

    def _close_waiting(self) -> None:
        """No headers in time (or room is needed): close without an answer, as for an idle
        kept-alive connection."""
        self._headers_arrived()
        if not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(header_timeout: float, max_connections: int) -> type[GuardedH11Protocol]:
    """A protocol class for one proxy server (`uvicorn.Config(http=...)`)."""
    return type(
        "KvxProxyH11Protocol",
        (GuardedH11Protocol,),
        {
            "header_timeout": header_timeout,
            "max_connections": max_connections,
            "waiting": OrderedDict(),
            "evicted": [0],
        },
    )
