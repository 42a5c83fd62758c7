"""A prompt's token ids for KV-aware routing: given as ids, or asked of a server's
`POST /tokenize` (vLLM's: the model's own tokenizer and chat template, so the ids are the ones
its engine hashes into blocks). Any failure gives None: the request is routed by load."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

import httpx

from kvx.proxy.pool import Upstream

log = logging.getLogger("kvx.proxy")

TOKENIZE_TIMEOUT_S = 5.0
MAX_TOKENIZE_ANSWER_BYTES = 16 * 1024 * 1024
CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
"""Fields of a chat request that change its prompt's tokens, passed on to /tokenize."""


def given_tokens(body: Mapping[str, Any]) -> list[int] | None:
    """The prompt when the client sent token ids (one prompt, a list of ints)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


def tokenize_request(path: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The /tokenize body for a completion request; None for prompts it cannot tokenize
    (several prompts at once, no prompt)."""
    model = {"model": body["model"]} if isinstance(body.get("model"), str) else {}
    if path.endswith("/chat/completions"):
        if not isinstance(body.get("messages"), list):
            return None
        return {**model, "messages": body["messages"]} | {
            k: body[k] for k in CHAT_FIELDS if k in body
        }
    if not isinstance(body.get("prompt"), str):
        return None
    return {**model, "prompt": body["prompt"]}


async def prompt_tokens(
    client: httpx.AsyncClient,
    server: Upstream,
    path: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    request_id: str,
) -> list[int] | None:
    """The prompt's token ids (from the body, or `server`'s /tokenize), or None."""
    if (tokens := given_tokens(body)) is not None:
        return tokens
    question = tokenize_request(path, body)
    if question is None:
        return None
    try:
        async with (
            asyncio.timeout(TOKENIZE_TIMEOUT_S),
            client.stream(
                "POST", f"{server.url}/tokenize", json=question, headers=dict(headers)
            ) as answer,
        ):
            content = bytearray()
            async for chunk in answer.aiter_raw():
                content += chunk
                if len(content) > MAX_TOKENIZE_ANSWER_BYTES:
                    raise ValueError(f"answered more than {MAX_TOKENIZE_ANSWER_BYTES} bytes")
        if answer.status_code != 200:
            raise ValueError(f"answered HTTP {answer.status_code}")
        tokens = json.loads(content).get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise ValueError("answered without a list of token ids")
        return tokens
    except (httpx.HTTPError, TimeoutError, ValueError, AttributeError) as exc:
        log.info(
            "request %s: no tokens from %s/tokenize (%s); routed by load",
            request_id,
            server.url,
            exc,
        )
        return None
