"""The only serialisation kvx uses between processes: msgpack via msgspec, typed and bounded.

A public module of kvx's API (for connectors that talk between processes). Never pickle: a peer
is untrusted, so every message is decoded into a declared type and refused
when it is larger than the caller's limit.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

__all__ = ["DEFAULT_MAX_BYTES", "WireError", "decode", "encode"]

DEFAULT_MAX_BYTES = 64 << 20

_encoder = msgspec.msgpack.Encoder()


class WireError(ValueError):
    """A message was too large or did not decode into the expected type."""


def encode(obj: Any) -> bytes:
    """msgpack bytes of a msgspec Struct, dataclass or plain value."""
    return _encoder.encode(obj)


def decode(
    data: bytes | bytearray | memoryview, type: type[T], max_bytes: int = DEFAULT_MAX_BYTES
) -> T:
    """Decode `data` into `type`; raise `WireError` if it is too big or malformed."""
    size = len(data)
    if size > max_bytes:
        raise WireError(f"message of {size} bytes exceeds the limit of {max_bytes} bytes")
    try:
        return msgspec.msgpack.decode(data, type=type)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"malformed {getattr(type, '__name__', type)} message: {exc}") from None
