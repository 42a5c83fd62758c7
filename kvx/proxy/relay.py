"""Passing D's streamed answer on so that a failure is seen as one by every client.

A stream that breaks after its 200 was sent cannot change its status any more. OpenAI's SDKs
raise on an event holding an `error` object, but `vllm bench serve`'s client (aiohttp) counts a
stream as a success once it saw one token, unless reading it raises. So a failed stream gets
one error event (vLLM's own, when D sent one; else the proxy's), no `[DONE]` after it, and then
the connection is closed without the chunked body's last chunk: every HTTP client reports an
incomplete body (aiohttp's `ClientPayloadError`, httpx's `RemoteProtocolError`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Final

from starlette.responses import StreamingResponse
from starlette.types import Send

MAX_EVENT_BYTES: Final = 8 * 1024 * 1024
"""The longest server-sent event of D's the proxy holds while it waits for the event's end."""

CUT: Final = b"\x00kvx-cut-stream\x00"
"""Yielded by a relay instead of bytes: close the client's connection mid-body (a failure)."""

UNFINISHED_RESPONSE = "ASGI callable returned without completing response."
"""What uvicorn logs when a response ends as a CUT ends it (on purpose, logged by the proxy)."""


class EventTooLarge(Exception):
    pass


class EventScanner:
    """Watches a stream of server-sent events passing through for an error event; holds only
    the event in progress (at most `limit` bytes), never delays a byte."""

    def __init__(self, limit: int = MAX_EVENT_BYTES) -> None:
        self.current = bytearray()
        self.limit = limit
        self.tail = b"\n\n"
        """The last two bytes passed on (is the stream between two events?)."""

    def feed(self, chunk: bytes) -> tuple[bytes, str | None]:
        """What of `chunk` to pass on, and the error an event ending in it reports (the
        bytes after that event are not passed on). EventTooLarge if an unfinished event
        passes the limit."""
        held = len(self.current)
        self.current += chunk
        start = 0
        while (end := _event_end(self.current, start)) >= 0:
            said = error_message(bytes(self.current[start:end]))
            start = end
            if said is not None:
                return self._passed(chunk[: end - held]), said
        del self.current[:start]
        if len(self.current) > self.limit:
            raise EventTooLarge(f"sent an event longer than {self.limit} bytes")
        return self._passed(chunk), None

    def _passed(self, data: bytes) -> bytes:
        self.tail = (self.tail + data)[-2:]
        return data

    def separator(self) -> bytes:
        """What closes off an event cut short, so the next event stands on its own."""
        return b"" if self.tail == b"\n\n" else b"\n\n"


def _event_end(buffer: bytearray, start: int) -> int:
    """Index just past the first event ending at or after `start`; -1 if none ends."""
    ends = [i for i in (buffer.find(b"\n\n", start), buffer.find(b"\r\n\r\n", start)) if i >= 0]
    if not ends:
        return -1
    first = min(ends)
    return first + (4 if buffer.startswith(b"\r\n\r\n", first) else 2)


def error_message(event: bytes) -> str | None:
    """The error an event reports (`data: {"error": ...}`, vLLM's shape), else None."""
    if b'"error"' not in event:
        return None
    data = b"".join(
        line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")
    )
    try:
        document = json.loads(data)
    except ValueError:
        return None
    if not isinstance(document, dict) or not document.get("error"):
        return None
    error = document["error"]
    message = error.get("message") if isinstance(error, dict) else error
    return str(message)[:500]


class RelayResponse(StreamingResponse):
    """A streamed answer whose body iterator may yield CUT: the response then ends without
    its last chunk and the server closes the connection."""

    body_iterator: AsyncIterator[bytes]

    async def stream_response(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        async for chunk in self.body_iterator:
            if chunk is CUT:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class QuietCutFilter(logging.Filter):
    """Drops uvicorn's error line for a response the proxy cut on purpose (it logs its own)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != UNFINISHED_RESPONSE


def quiet_cut_streams() -> None:
    """Install QuietCutFilter on uvicorn's error logger (once)."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, QuietCutFilter) for f in logger.filters):
        logger.addFilter(QuietCutFilter())
