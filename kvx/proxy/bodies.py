"""A client's request body, held to what the proxy can forward: strict JSON (no NaN, Infinity or
out-of-range numbers), valid Unicode (no lone surrogates), bounded nesting, and the fields the
proxy itself reads of the right type. Anything else is a 400 naming what is wrong."""

from __future__ import annotations

import json
import math
from typing import Any

from kvx.proxy.errors import ProxyError

MAX_BODY_DEPTH = 64
"""Deepest nesting of objects and arrays accepted (OpenAI requests nest a few levels)."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _path(parent: str, key: str | int) -> str:
    return f"{parent}[{key}]" if isinstance(key, int) else f"{parent}.{key[:40]}"


def _unicode_problem(text: str) -> str | None:
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"holds a lone surrogate (\\u{ord(text[exc.start]):04x}), which is not valid Unicode"
    return None


def _shape_problem(document: Any) -> str | None:
    """What makes a parsed body unforwardable (None if nothing): nesting deeper than
    MAX_BODY_DEPTH, a key or string that is not valid Unicode. Iterative: no recursion."""
    todo: list[tuple[Any, int, str]] = [(document, 1, "$")]
    while todo:
        item, level, where = todo.pop()
        if isinstance(item, str):
            problem = _unicode_problem(item)
            if problem is not None:
                return f"the string at {where} {problem}"
            continue
        if not isinstance(item, dict | list):
            continue
        if level > MAX_BODY_DEPTH:
            return f"it nests deeper than {MAX_BODY_DEPTH} levels (at {where})"
        if isinstance(item, list):
            todo.extend((child, level + 1, _path(where, i)) for i, child in enumerate(item))
            continue
        for key, child in item.items():
            problem = _unicode_problem(key)
            if problem is not None:
                return f"a key in {where} {problem}"
            todo.append((child, level + 1, _path(where, key)))
    return None


def parse_body(body: bytes | bytearray) -> dict[str, Any]:
    """The JSON object in `body`; ProxyError(400) naming what is wrong with it otherwise."""
    try:
        document = json.loads(body, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ProxyError(
            400, f"the request body nests deeper than {MAX_BODY_DEPTH} levels of JSON"
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ProxyError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ProxyError(
            400, f"the request body must be a JSON object, not {type(document).__name__}"
        )
    problem = _shape_problem(document)
    if problem is not None:
        raise ProxyError(400, f"the request body cannot be forwarded: {problem}")
    stream = document.get("stream")
    if stream is not None and not isinstance(stream, bool):
        shown = json.dumps(stream)[:40]
        raise ProxyError(400, f"'stream' must be true, false or null, not {shown}")
    return document
