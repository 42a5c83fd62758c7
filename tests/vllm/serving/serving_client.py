"""The serving tests' OpenAI client: sends token-id prompts to `/v1/completions` (streaming or
not), collects the generated token ids (`return_token_ids`) and the prompt's cached-token count,
and reports every failure as data (HTTP status and body, or the exception), never by raising.

Also a script, for clients that must run inside a network namespace (`ip netns exec NS python
client.py URL < workload.json > results.json`); the workload and results are JSON lists.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx


@dataclass
class Request:
    """One completion request: a token-id prompt, how many tokens to generate, streamed or not;
    `burst` groups requests sent together."""

    prompt: list[int]
    max_tokens: int
    stream: bool = False
    burst: int = 0


@dataclass
class Result:
    """What came back: generated token ids and cached prompt tokens, or the error."""

    tokens: list[int] = field(default_factory=list)
    cached_tokens: int | None = None
    error: str | None = None
    seconds: float = 0.0
    first_token_seconds: float | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """The answer's `kv_transfer_params` (non-streamed answers carry them)."""

    @property
    def ok(self) -> bool:
        return self.error is None


def body(model: str, req: Request) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": req.stream,
    }
    if req.stream:
        payload["stream_options"] = {"include_usage": True}
    return payload


def cached_of(usage: dict[str, Any] | None) -> int | None:
    details = (usage or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return int(value) if value is not None else None


def complete(client: httpx.Client, url: str, model: str, req: Request) -> Result:
    """Send one request to `url` (a server's base URL); never raises."""
    start = time.monotonic()
    result = Result()
    try:
        if not req.stream:
            reply = client.post(f"{url}/v1/completions", json=body(model, req))
            if reply.status_code != 200:
                result.error = f"HTTP {reply.status_code}: {reply.text[:500]}"
            else:
                data = reply.json()
                result.tokens = list(data["choices"][0].get("token_ids") or [])
                result.cached_tokens = cached_of(data.get("usage"))
                result.kv_transfer_params = data.get("kv_transfer_params")
                result.first_token_seconds = time.monotonic() - start
        else:
            with client.stream("POST", f"{url}/v1/completions", json=body(model, req)) as reply:
                if reply.status_code != 200:
                    reply.read()
                    result.error = f"HTTP {reply.status_code}: {reply.text[:500]}"
                else:
                    read_stream(reply, result, start)
    except Exception as exc:  # reported as the request's result
        result.error = f"{type(exc).__name__}: {exc}"
    result.seconds = time.monotonic() - start
    if result.error is None and len(result.tokens) != req.max_tokens:
        result.error = f"got {len(result.tokens)} tokens, asked for {req.max_tokens}"
    return result


def read_stream(reply: httpx.Response, result: Result, start: float) -> None:
    done = False
    for line in reply.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = f"error in stream: {json.dumps(chunk['error'])[:500]}"
            return
        for choice in chunk.get("choices") or []:
            ids = choice.get("token_ids") or []
            if ids and result.first_token_seconds is None:
                result.first_token_seconds = time.monotonic() - start
            result.tokens += ids
        if chunk.get("usage"):
            result.cached_tokens = cached_of(chunk["usage"])
    if not done:
        result.error = "the stream ended without [DONE]"


def run(
    url: str,
    model: str,
    requests: list[Request],
    gap_s: float = 0.0,
    concurrency: int = 4,
    timeout_s: float = 120.0,
) -> list[Result]:
    """Send `requests` burst by burst (each burst concurrently, `gap_s` idle seconds between
    bursts); results in request order."""
    results: list[Result | None] = [None] * len(requests)
    bursts = sorted({r.burst for r in requests})
    with (
        httpx.Client(timeout=timeout_s) as client,
        ThreadPoolExecutor(concurrency) as pool,
    ):
        for n, burst in enumerate(bursts):
            if n and gap_s:
                time.sleep(gap_s)
            index = [i for i, r in enumerate(requests) if r.burst == burst]
            futures = {i: pool.submit(complete, client, url, model, requests[i]) for i in index}
            for i, future in futures.items():
                results[i] = future.result()
    return [r for r in results if r is not None]


def main() -> None:
    url, model = sys.argv[1], sys.argv[2]
    gap_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    requests = [Request(**r) for r in json.load(sys.stdin)]
    json.dump([asdict(r) for r in run(url, model, requests, gap_s)], sys.stdout)


if __name__ == "__main__":
    main()
