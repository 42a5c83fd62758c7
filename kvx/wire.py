"""The only serialisation kvx uses between processes: msgpack via msgspec, typed and bounded.

A public module of kvx's API (for connectors that talk between processes). Never pickle: a peer
is untrusted, so every message is decoded into a declared type (whose fields carry their own
bounds) and refused when it is larger than the caller's limit. Any malformed input, whatever
msgspec or the type's checks raise on it, becomes `WireError`.

With a shared secret a message is sealed: an HMAC-SHA256 tag over a domain (which kind of
message it is), the caller's context (e.g. the nonce it answers) and the body, in front of the
body. `unseal` checks the tag before a single byte of the body is decoded. `ReplayGuard`
refuses a sealed request seen before or stamped outside a time window, in bounded memory.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from functools import lru_cache
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

__all__ = [
    "DEFAULT_MAX_BYTES",
    "MAC_BYTES",
    "ReplayGuard",
    "WireError",
    "curve_client",
    "curve_keys",
    "curve_server",
    "decode",
    "decode_sealed",
    "encode",
    "mac",
    "recv_frames",
    "seal",
    "unseal",
]

DEFAULT_MAX_BYTES = 64 << 20
MAC_BYTES = 32
"""Length of a seal's tag (HMAC-SHA256)."""

_encoder = msgspec.msgpack.Encoder()


class WireError(ValueError):
    """A message was too large, failed authentication or did not decode into its type."""


def encode(obj: Any) -> bytes:
    """msgpack bytes of a msgspec Struct, dataclass or plain value."""
    return _encoder.encode(obj)


def decode(
    data: bytes | bytearray | memoryview, type: type[T], max_bytes: int = DEFAULT_MAX_BYTES
) -> T:
    """Decode `data` into `type`; raise `WireError` if it is too big or malformed in any way."""
    name = getattr(type, "__name__", str(type))
    size = len(data)
    if size > max_bytes:
        raise WireError(f"{name} message of {size} bytes exceeds the limit of {max_bytes} bytes")
    try:
        return msgspec.msgpack.decode(data, type=type)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"malformed {name} message: {exc}") from None
    except (ValueError, TypeError, OverflowError, RecursionError, MemoryError) as exc:
        # e.g. UnicodeDecodeError on invalid UTF-8 in a str, or a __post_init__ check
        raise WireError(f"malformed {name} message: {exc.__class__.__name__}: {exc}") from None


def mac(secret: str, domain: bytes, *parts: bytes | memoryview) -> bytes:
    """HMAC-SHA256 under `secret` over `domain` and `parts`, each length-prefixed."""
    tag = hmac.new(secret.encode("utf-8", "surrogatepass"), digestmod=hashlib.sha256)
    for part in (domain, *parts):
        tag.update(len(part).to_bytes(8, "little"))
        tag.update(part)
    return tag.digest()


def seal(secret: str | None, domain: bytes, body: bytes, *context: bytes) -> bytes:
    """`body` with its tag in front (just `body` without a secret)."""
    if secret is None:
        return body
    return mac(secret, domain, *context, body) + body


def unseal(
    secret: str | None,
    domain: bytes,
    data: bytes | bytearray | memoryview,
    *context: bytes,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> memoryview:
    """The body of a sealed message, after its size and (with a secret) its tag are checked;
    raise `WireError` otherwise. Nothing of the body is looked at before the tag matched."""
    view = memoryview(data).cast("B")
    if view.nbytes > max_bytes + (MAC_BYTES if secret is not None else 0):
        raise WireError(f"message of {view.nbytes} bytes exceeds the limit of {max_bytes} bytes")
    if secret is None:
        return view
    if view.nbytes < MAC_BYTES:
        raise WireError(
            f"authentication failed: a {view.nbytes}-byte message cannot carry its "
            f"{MAC_BYTES}-byte tag (is the shared secret set on both sides?)"
        )
    body = view[MAC_BYTES:]
    if not hmac.compare_digest(view[:MAC_BYTES], mac(secret, domain, *context, body)):
        raise WireError("authentication failed: wrong or missing shared secret")
    return body


def decode_sealed(
    data: bytes | bytearray | memoryview,
    type: type[T],
    secret: str | None,
    domain: bytes,
    *context: bytes,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> T:
    """`unseal` then `decode`: authenticate first, then decode into `type`."""
    body = unseal(secret, domain, data, *context, max_bytes=max_bytes)
    return decode(body, type, max_bytes=max_bytes)


class ReplayGuard:
    """Refuses a request whose nonce was seen within the window or whose timestamp is more than
    `window_s` from our clock. Remembers at most `max_nonces` nonces (each for 2 windows, past
    which its timestamp is refused anyway); when full it refuses new requests rather than
    forget a nonce that could still be replayed."""

    def __init__(
        self,
        window_s: float = 120.0,
        max_nonces: int = 1 << 16,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.window_s = window_s
        self.max_nonces = max_nonces
        self._clock = clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # nonce -> forget after

    def check(self, nonce: bytes, timestamp: float) -> str | None:
        """None if the request is fresh (its nonce is then remembered), else why not."""
        now = self._clock()
        while self._seen:
            first, until = next(iter(self._seen.items()))
            if until > now:
                break
            del self._seen[first]
        if not math.isfinite(timestamp) or abs(now - timestamp) > self.window_s:
            skew = now - timestamp if math.isfinite(timestamp) else timestamp
            return (
                f"stale request: its timestamp is {skew:+.0f}s from this host's clock; at most "
                f"{self.window_s:g}s allowed (are both clocks synchronised?)"
            )
        if nonce in self._seen:
            return "replayed request: this nonce was already used"
        if len(self._seen) >= self.max_nonces:
            return f"too many requests: {self.max_nonces} within {self.window_s:g}s"
        self._seen[nonce] = now + 2 * self.window_s
        return None

    def __len__(self) -> int:
        return len(self._seen)


def recv_frames(socket: Any, max_frames: int) -> tuple[list[Any], int]:
    """One multipart message of a ZMQ socket (one that polled readable), read frame by frame:
    (its first `max_frames` frames, how many it had). Frames past `max_frames` are read and
    dropped one at a time, so a message of millions of tiny frames costs the caller no more
    memory than `max_frames` of them (libzmq itself queues a whole message, about 64 bytes a
    frame, before any of it can be read: no socket option caps the frame count)."""
    frames: list[Any] = []
    count = 0
    while True:
        frame = socket.recv(copy=False)
        count += 1
        if count <= max_frames:
            frames.append(frame)
        if not frame.more:
            return frames, count


CURVE_INFO = b"kvx-zmq-curve-v1"
"""Derivation label of the CURVE keys (a change of it is a wire-incompatible change)."""
ZAP_DOMAIN = b"kvx"


@lru_cache(maxsize=8)
def curve_keys(secret: str, role: str) -> tuple[bytes, bytes]:
    """The ZMQ CURVE key pair (public, secret; Z85) of `role` ("server" or "client") derived
    from the shared secret: HMAC-SHA256(secret, label + role) is the 32-byte secret key. Every
    holder of the secret derives the same keys, so both ends of kvx agree without exchanging any."""
    import zmq
    from zmq.utils import z85

    raw = hmac.new(
        secret.encode("utf-8", "surrogatepass"), CURVE_INFO + b"/" + role.encode(), hashlib.sha256
    ).digest()
    private = z85.encode(raw)
    return zmq.curve_public(private), private


class _Allow:
    """ZAP credentials provider: only the client key derived from the secret passes."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.client_public)


def curve_server(socket: Any, secret: str) -> Any:
    """Make a (not yet bound) ZMQ socket a CURVE server that admits only clients holding
    `secret`: a peer without it fails the handshake, so libzmq queues none of its messages.
    Starts and returns a ZAP authenticator on the socket's context (one per context); the
    caller stops it (`.stop()`) after closing its sockets."""
    import zmq
    from zmq.auth.thread import ThreadAuthenticator

    server_public, server_secret = curve_keys(secret, "server")
    auth = ThreadAuthenticator(socket.context)
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN.decode(), _Allow(curve_keys(secret, "client")[0]))
    socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    socket.setsockopt(zmq.CURVE_SECRETKEY, server_secret)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, server_public)
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    return auth


def curve_client(socket: Any, secret: str) -> None:
    """Make a (not yet connected) ZMQ socket a CURVE client of a `curve_server` with `secret`."""
    import zmq

    client_public, client_secret = curve_keys(secret, "client")
    socket.setsockopt(zmq.CURVE_SERVERKEY, curve_keys(secret, "server")[0])
    socket.setsockopt(zmq.CURVE_PUBLICKEY, client_public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, client_secret)
