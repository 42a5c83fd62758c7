"""Redis backend: `redis://host:port/db` (and `rediss://`, `unix://`) on a Redis server.

Two clients share the work:

- Bulk values (`put_vectored`/`get_vectored`, what the connector saves and loads) go through
  a small RESP client of our own (`resp.RespConnection`, a few pooled TCP connections): a
  value made of many buffers in the engine's KV cache is sent from them with `sendmsg` and
  read back into them with `recvmsg_into`, one kernel copy each way. Through redis-py a save
  would first join the buffers and a load would pass through hiredis' buffer and a bytes
  object before being copied into the cache.
- Everything else (ping, `put_many`, `get_many`/`get_into` with GETRANGE, exists, TTL) goes
  through one redis-py client, as do the vectored calls for TLS (`rediss://`) and unix-socket
  URLs, which the RESP client does not speak (there the buffers are joined on save and
  copied on load), and all calls when the config sets `redis_client: "redis-py"` (for
  proxies or managed Redis that the small client may not suit, and for debugging).

One value per key, each written with a single SET (a value is whole or absent); a batch of
keys is one pipelined round trip. Nothing waits on a dead or hung server beyond `timeout_s`
per socket call, and calls are not retried (a failed call raises; the connector turns that
into load errors, lookup misses or save errors).

`valkey://` and `valkeys://` are the same backend (Valkey speaks RESP). A URL naming a node
of a Redis or Valkey Cluster opens the whole cluster (see `redis_cluster`): redis-py's
cluster client for the plain calls, and the fast path sending each master the values of the
keys it serves.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

import kvx
from kvx.plugins.storage.backends.base import BackendOptions, StorageBackend, copy_into
from kvx.plugins.storage.backends.redis_cluster import (
    Address,
    SlotRoutes,
    connect_kwargs,
    is_cluster_node,
    is_redirect,
    open_cluster,
)
from kvx.plugins.storage.backends.resp import RespConnection, RespReplyError

KEY_PREFIX = "kvx/"
POOL_IDLE_MAX = 8  # idle RESP connections kept for reuse, per server
VALKEY_SCHEMES = {"valkey": "redis", "valkeys": "rediss"}  # redis-py's names for them


def _cluster_db_message(url: str, db: int) -> str:
    return (
        f"storage_url {kvx.redact_url(url)!r} names database {db}, but it is a node of a Redis "
        "Cluster, which has only database 0: use /0 or no database"
    )


class RedisBackend(kvx.SupportsListing, StorageBackend):
    """A pipelined key -> bytes store on a Redis server (values up to 512 MB, optional TTL)."""

    def __init__(self, url: str, options: BackendOptions) -> None:
        self.url = url
        self.ttl_s = options.ttl_s
        self.timeout_s = options.timeout_s
        # values per vectored round trip: up to 4 MiB (one 2 MiB value of a 32-layer model, many
        # small ones), so each is checksummed while it is in the CPU's cache; two IO threads
        # keep the server busy in between (measured: 16 MiB batches were 1.2-1.5x slower)
        self.group_bytes = 4 << 20
        self._idle: list[RespConnection] = []  # of every server, newest last
        self._lock = threading.Lock()
        self._closed = False
        self._routes: SlotRoutes | None = None
        scheme, sep, rest = url.partition("://")
        redis_url = VALKEY_SCHEMES.get(scheme.lower(), scheme) + sep + rest
        try:
            self.client: redis.Redis | RedisCluster = redis.Redis.from_url(
                redis_url,
                password=options.password,
                socket_timeout=options.timeout_s,
                socket_connect_timeout=options.timeout_s,
                retry=Retry(NoBackoff(), 0),
            )
        except ValueError as exc:
            raise ValueError(
                f"storage_url {kvx.redact_url(url)!r} is not a Redis URL ({exc}); "
                "use redis://host:port/db"
            ) from None
        try:
            self.client.ping()
        except redis.AuthenticationError as exc:
            self.client.close()
            raise ConnectionError(
                f"the Redis server at {kvx.redact_url(url)!r} refused the credentials: {exc}. "
                "Fix the user name or password (storage_url or redis_password)"
            ) from None
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self.client.close()
            raise ConnectionError(
                f"cannot reach the Redis server at {kvx.redact_url(url)!r}: {exc}. Start one (for "
                "example `redis-server --port 6379 --bind 127.0.0.1`) or fix storage_url"
            ) from None
        except redis.ResponseError as exc:  # SELECT db on a cluster node
            self.client.close()
            if "cluster mode" not in str(exc):
                raise
            db = self.client.connection_pool.connection_kwargs.get("db", 0)
            raise ValueError(_cluster_db_message(url, db)) from None
        pool = self.client.connection_pool
        self._resp = (
            pool.connection_class is redis.connection.Connection and options.redis_client == "resp"
        )
        if is_cluster_node(self.client):
            self._open_cluster(redis_url, options)
        self._connect_kwargs = connect_kwargs(self.client)
        self._address: Address = (
            self._connect_kwargs.get("host", "localhost"),
            int(self._connect_kwargs.get("port", 6379)),
        )

    def _open_cluster(self, url: str, options: BackendOptions) -> None:
        """Replace the single-node client by a cluster client (the URL named a cluster node)."""
        self.client.close()
        try:
            cluster = open_cluster(url, options.password, options.timeout_s)
        except redis.RedisError as exc:
            raise ConnectionError(
                f"{kvx.redact_url(self.url)!r} is a Redis Cluster node, but the cluster could not "
                f"be discovered from it: {exc}"
            ) from None
        self.client = cluster
        self._routes = SlotRoutes(cluster)

    def _by_node(self, keys: Sequence[str]) -> dict[Address, list[int]]:
        """The indices of `keys` (with the prefix) grouped by the server that holds them."""
        if self._routes is None:
            return {self._address: list(range(len(keys)))}
        return self._routes.by_node(keys)

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

    def put_vectored(self, items: Sequence[tuple[str, Sequence[bytes | memoryview]]]) -> None:
        """Store each key = the concatenation of its buffers (sent from them, not joined);
        raise on failure (values already written may stay)."""
        if not items:
            return
        if not self._resp:
            self.put_many([(key, b"".join(parts)) for key, parts in items])
            return
        values = [(KEY_PREFIX + key, [memoryview(p) for p in parts]) for key, parts in items]
        for address, indices in self._by_node([key for key, _ in values]).items():
            group = [values[i] for i in indices]
            try:
                with self._conn(address) as conn:
                    conn.set_vectored(group, self.ttl_s)
            except RespReplyError as exc:
                if not self._redirected(exc):
                    raise
                # keys another node serves now: through redis-py, which follows redirects
                self.put_many([(items[indices[i]][0], b"".join(group[i][1])) for i in exc.failed])

    def get_vectored(
        self, keys: Sequence[str], buffers: Sequence[Sequence[memoryview]]
    ) -> list[int | None]:
        """Per key its stored size (None where absent); a value exactly as long as the key's
        buffers together is read into them, in order; otherwise they are untouched."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffer lists; one per key")
        if not keys:
            return []
        if not self._resp:
            return self._get_vectored_redis_py(keys, buffers)
        full = [KEY_PREFIX + key for key in keys]
        sizes: list[int | None] = [None] * len(keys)
        for address, indices in self._by_node(full).items():
            names, bufs = [full[i] for i in indices], [buffers[i] for i in indices]
            try:
                with self._conn(address) as conn:
                    got = conn.get_vectored(names, bufs)
            except RespReplyError as exc:
                if not self._redirected(exc):
                    raise
                got = exc.sizes
                moved = sorted(exc.failed)
                retried = self._get_vectored_redis_py(
                    [keys[indices[i]] for i in moved], [bufs[i] for i in moved]
                )
                for i, size in zip(moved, retried, strict=True):
                    got[i] = size
            for i, size in zip(indices, got, strict=True):
                sizes[i] = size
        return sizes

    @contextmanager
    def _conn(self, address: Address) -> Iterator[RespConnection]:
        """A pooled RESP connection to `address` for one call (closed if the call fails; a
        cluster's slot map is re-read when a node cannot be reached)."""
        try:
            conn = self._take(address)
        except (ConnectionError, TimeoutError):
            self._node_failed()
            raise
        try:
            yield conn
        except (ConnectionError, TimeoutError):
            conn.close()
            self._node_failed()
            raise
        except BaseException:
            conn.close()
            raise
        self._give(conn)

    def _node_failed(self) -> None:
        """A server could not be reached: a cluster's masters may have changed."""
        if self._routes is not None:
            self._routes.refresh()

    def _redirected(self, exc: RespReplyError) -> bool:
        """Whether every failed key of a cluster batch was only redirected (MOVED, ASK,
        TRYAGAIN, CLUSTERDOWN), so redis-py can follow it."""
        return self._routes is not None and all(is_redirect(m) for m in exc.failed.values())

    def _get_vectored_redis_py(
        self, keys: Sequence[str], buffers: Sequence[Sequence[memoryview]]
    ) -> list[int | None]:
        """get_vectored through redis-py (TLS, unix sockets): GETRANGE, then copy. A value
        longer than the buffers is reported as their total + 1."""
        views = [[memoryview(b).cast("B") for b in parts] for parts in buffers]
        totals = [sum(v.nbytes for v in parts) for parts in views]
        pipe = self.client.pipeline(transaction=False)
        for key, total in zip(keys, totals, strict=True):
            pipe.getrange(KEY_PREFIX + key, 0, total)
        sizes: list[int | None] = []
        for parts, total, value in zip(views, totals, pipe.execute(), strict=True):
            if value and len(value) == total:
                copy_into(parts, value)
            sizes.append(len(value) if value else None)
        return sizes

    def _take(self, address: Address) -> RespConnection:
        """An idle RESP connection to `address`, or a new one."""
        with self._lock:
            if self._closed:
                raise ConnectionError(
                    f"the Redis backend for {kvx.redact_url(self.url)!r} is closed"
                )
            wanted = f"{address[0]}:{address[1]}"
            for i in range(len(self._idle) - 1, -1, -1):
                if self._idle[i].address == wanted:
                    return self._idle.pop(i)
        kw = self._connect_kwargs
        return RespConnection(
            address[0],
            address[1],
            int(kw.get("db", 0)),
            kw.get("username"),
            kw.get("password"),
            self.timeout_s,
        )

    def _give(self, conn: RespConnection) -> None:
        """Keep a connection after a successful call (a failed call's is closed instead)."""
        with self._lock:
            kept = sum(c.address == conn.address for c in self._idle)
            if not self._closed and kept < POOL_IDLE_MAX:
                self._idle.append(conn)
                return
        conn.close()

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(KEY_PREFIX + key)
        return [bool(n) for n in pipe.execute()]

    def list_keys(self, prefix: str = "") -> Iterator[kvx.StoredEntry]:
        """`SupportsListing.list_keys`: SCAN (every master of a cluster), then STRLEN in
        batches. Redis keeps no write time: `modified` is None."""
        pattern = KEY_PREFIX + _glob_escaped(prefix) + "*"
        batch: list[bytes] = []
        for name in self.client.scan_iter(match=pattern, count=1000):
            batch.append(name)
            if len(batch) == 1000:
                yield from self._sized(batch)
                batch = []
        yield from self._sized(batch)

    def _sized(self, names: list[bytes]) -> Iterator[kvx.StoredEntry]:
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.strlen(name)
        for name, size in zip(names, pipe.execute(), strict=True):
            if size:  # expired or removed since the SCAN
                key = name.decode("utf-8", "replace")[len(KEY_PREFIX) :]
                yield kvx.StoredEntry(key, int(size))

    def delete_many(self, keys: Sequence[str]) -> int:
        """`SupportsListing.delete_many`: UNLINK each key."""
        if not keys:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.unlink(KEY_PREFIX + key)
        return sum(int(n) for n in pipe.execute())

    def ttl(self, key: str) -> int:
        """Seconds until `key` expires (-1: never, -2: absent), for checks and tests."""
        return int(self.client.ttl(KEY_PREFIX + key))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        self.client.close()


def _glob_escaped(text: str) -> str:
    """`text` matched literally by a Redis SCAN MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
