"""A small real OpenAI-like HTTP server that stands in for a vLLM prefill or decode server in the
proxy's tests (real `vllm serve` P/D runs are the serving tests' job, tests/vllm).

It speaks the part of vLLM's API the proxy uses, over real HTTP on a loopback port: GET /health,
GET /v1/models, POST /v1/completions, /v1/chat/completions and /tokenize. A request carrying
`kv_transfer_params.do_remote_decode` is answered as a vLLM prefill server answers (one token and
`kv_transfer_params` naming this server's blocks); any other is answered as a decode server
answers, whole or as server-sent events. `Behaviour` lets a test make it hang, fail, look unhealthy
or cut a stream; every request it gets is recorded.

Run as a script (`python upstream_server.py --port N --name D2`) it serves the same app in its own
process, so a test can kill it for real.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

HOLD_LIMIT_S = 20.0
"""The longest a held request waits for its release, so a failed test cannot hang the stub."""


@dataclass
class Received:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class Behaviour:
    """What the stub does; a test may change it while the stub runs."""

    name: str
    health_status: int = 200
    completion_status: int = 200
    """Any other status answers completions with an error body of that status."""
    prefill_params: dict[str, Any] | None = None
    """The kv_transfer_params a prefill answer carries (default: this server's made-up blocks)."""
    hold: threading.Event | None = None
    """If set, completions wait for it (at most HOLD_LIMIT_S) before answering."""
    stream_chunks: list[bytes] | None = None
    """The exact bytes a streamed decode answer sends, chunk by chunk."""
    hold_after_first_chunk: threading.Event | None = None
    """If set, a stream sends its first chunk, then waits for this before sending the rest."""
    cut_stream_after: int | None = None
    """Send this many chunks, then drop the connection mid-answer."""
    received: list[Received] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    """Paths of held requests whose client (the proxy) disconnected while they were held."""

    def completions(self) -> list[Received]:
        return [r for r in self.received if r.path.endswith("completions")]


def default_stream(name: str) -> list[bytes]:
    events = [
        {"id": "cmpl-1", "choices": [{"index": 0, "text": f" token{i} from {name}"}]}
        for i in range(3)
    ]
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


async def _wait(event: threading.Event, request: Request | None = None) -> bool:
    """Wait for `event` (at most HOLD_LIMIT_S); False if `request`'s client left first."""
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not event.is_set() and time.monotonic() < deadline:
        if request is not None and await request.is_disconnected():
            return False
        await asyncio.sleep(0.01)
    return True


def build_upstream_app(behaviour: Behaviour) -> Starlette:
    async def health(request: Request) -> Response:
        return JSONResponse({"name": behaviour.name}, behaviour.health_status)

    async def models(request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": "tiny", "served_by": behaviour.name}]}
        )

    async def completion(request: Request) -> Response:
        body = await request.json()
        behaviour.received.append(Received(request.url.path, body, dict(request.headers)))
        if behaviour.hold is not None and not await _wait(behaviour.hold, request):
            behaviour.left.append(request.url.path)
            return Response(status_code=499)
        if behaviour.completion_status != 200:
            return JSONResponse(
                {"error": {"message": f"{behaviour.name} refuses", "code": 42}},
                behaviour.completion_status,
            )
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            kv = behaviour.prefill_params
            if kv is None:
                kv = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_engine_id": behaviour.name,
                    "remote_block_ids": [3, 1, 4],
                    "remote_host": "127.0.0.1",
                    "remote_port": 5555,
                }
            answer = {"id": "p", "choices": [{"index": 0, "text": "x"}], "kv_transfer_params": kv}
            return JSONResponse(answer)
        if body.get("stream") is True:
            return StreamingResponse(_stream(), media_type="text/event-stream")
        answer = {
            "id": "d",
            "choices": [{"index": 0, "text": f"decoded by {behaviour.name}"}],
            "kv_transfer_params_received": params,
        }
        return JSONResponse(answer)

    async def tokenize(request: Request) -> Response:
        """vLLM's POST /tokenize, with one token per character (code point)."""
        body = await request.json()
        behaviour.received.append(Received(request.url.path, body, dict(request.headers)))
        text = body.get("prompt") or "".join(str(m.get("content")) for m in body["messages"])
        tokens = [ord(c) for c in text]
        return JSONResponse({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    async def _stream() -> AsyncIterator[bytes]:
        chunks = behaviour.stream_chunks or default_stream(behaviour.name)
        for i, chunk in enumerate(chunks):
            if behaviour.cut_stream_after is not None and i == behaviour.cut_stream_after:
                raise ConnectionAbortedError("stub cuts the stream on purpose")
            if i == 1 and behaviour.hold_after_first_chunk is not None:
                await _wait(behaviour.hold_after_first_chunk)
            yield chunk

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/completions", completion, methods=["POST"]),
            Route("/v1/chat/completions", completion, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
        ]
    )


def listener(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    return sock


class StubServer:
    """The stub serving from a thread of the test process."""

    def __init__(self, name: str, port: int = 0) -> None:
        self.behaviour = Behaviour(name)
        self._sock = listener(port)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            build_upstream_app(self.behaviour), log_config=None, access_log=False, lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            assert time.monotonic() < deadline, f"stub {name} did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        if self.behaviour.hold is not None:
            self.behaviour.hold.set()
        if self.behaviour.hold_after_first_chunk is not None:
            self.behaviour.hold_after_first_chunk.set()
        self._server.should_exit = True
        self._thread.join(15)
        self._sock.close()
        assert not self._thread.is_alive(), f"stub {self.behaviour.name} did not stop"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True)
    args = parser.parse_args()
    sock = listener(args.port)
    print(f"stub {args.name} serving on {args.port}", flush=True)
    app = build_upstream_app(Behaviour(args.name))
    uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False)).run(sockets=[sock])


if __name__ == "__main__":
    main()
