"""Redis backend: `redis://host:port/db` (and `rediss://`) through one redis-py client.

One value per key, each written with a single SET (a value is whole or absent, and is sent
from the caller's buffer); a batch of keys is one pipelined round trip. Values are read with
GETRANGE so an oversized value never comes back whole. hiredis parses replies when installed.

Nothing waits on a dead or hung server beyond `timeout_s` per call: connects and replies are
bounded by it and calls are not retried (a failed call raises; the connector turns that into
load errors, lookup misses or save errors).
"""

from __future__ import annotations

from collections.abc import Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvx.plugins.storage.backends.base import BackendOptions

KEY_PREFIX = "kvx/"


class RedisBackend:
    """A pipelined key -> bytes store on a Redis server (values up to 512 MB, optional TTL)."""

    def __init__(self, url: str, options: BackendOptions) -> None:
        self.url = url
        self.ttl_s = options.ttl_s
        try:
            self.client = redis.Redis.from_url(
                url,
                socket_timeout=options.timeout_s,
                socket_connect_timeout=options.timeout_s,
                retry=Retry(NoBackoff(), 0),
            )
        except ValueError as exc:
            raise ValueError(
                f"storage_url {url!r} is not a Redis URL ({exc}); use redis://host:port/db"
            ) from None
        try:
            self.client.ping()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self.client.close()
            raise ConnectionError(
                f"cannot reach the Redis server at {url!r}: {exc}. Start one (for example "
                "`redis-server --port 6379 --bind 127.0.0.1`) or fix storage_url"
            ) from None

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        if not items:
            return
        pipe = self.client.pipeline(transaction=False)
        for key, value in items:
            pipe.set(KEY_PREFIX + key, value, ex=self.ttl_s)
        pipe.execute()

    def get_many(self, keys: Sequence[str], max_bytes: int) -> list[bytes | None]:
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.getrange(KEY_PREFIX + key, 0, max_bytes)
        # GETRANGE answers "" for a missing key; no stored value is empty.
        return [value or None for value in pipe.execute()]

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        """Read each value into its buffer when it is exactly that long, in one pipelined
        round trip: per key the stored size, or `len(buffer) + 1` if longer (None where
        absent)."""
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for key, buf in zip(keys, buffers, strict=True):
            pipe.getrange(KEY_PREFIX + key, 0, len(buf))
        sizes: list[int | None] = []
        for buf, value in zip(buffers, pipe.execute(), strict=True):
            if value and len(value) == len(buf):
                buf[:] = value
            sizes.append(len(value) if value else None)
        return sizes

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(KEY_PREFIX + key)
        return [bool(n) for n in pipe.execute()]

    def ttl(self, key: str) -> int:
        """Seconds until `key` expires (-1: never, -2: absent), for checks and tests."""
        return int(self.client.ttl(KEY_PREFIX + key))

    def close(self) -> None:
        self.client.close()
