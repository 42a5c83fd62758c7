"""Redis Cluster / Valkey Cluster for the Redis backend: finding out whether a URL names a
cluster node, and which node serves each key.

A URL naming any node of a cluster is enough: redis-py's `RedisCluster` discovers the others
(CLUSTER SLOTS) and keeps the slot map, following `MOVED` (patching the map, re-reading it
every few redirects), `ASK`, `TRYAGAIN` and `CLUSTERDOWN` itself. kvx's RESP fast path reads
that same map to send each node its keys' values; a key the node answers with a redirect or a
cluster error is sent again through redis-py, which follows it. A node that cannot be reached
makes the map be re-read (at most every `REFRESH_MIN_S`) before the error is raised, so the
calls after a failover go to the promoted replica.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.retry import Retry

REDIRECTS = ("MOVED ", "ASK ", "TRYAGAIN", "CLUSTERDOWN")
"""Error replies a cluster node sends for a key it does not serve right now."""
REFRESH_MIN_S = 0.5  # the slot map is re-read after a node failure at most this often
CLUSTER_RETRIES = 2  # redis-py's retries of a call that met a dead node or CLUSTERDOWN

Address = tuple[str, int]


def is_cluster_node(client: redis.Redis) -> bool:
    """Whether the server `client` talks to runs in cluster mode (a server refusing INFO, as
    some proxies do, is taken for a single node)."""
    try:
        info = client.info("cluster")
    except redis.ResponseError:
        return False
    return bool(int(info.get("cluster_enabled", 0)))


def open_cluster(url: str, password: str | None, timeout_s: float) -> RedisCluster:
    """A redis-py cluster client discovering the cluster from the node `url` names."""
    return RedisCluster.from_url(
        url,
        password=password,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), CLUSTER_RETRIES),
    )


class SlotRoutes:
    """Which node serves each key, from redis-py's slot map of `client`."""

    def __init__(self, client: RedisCluster) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._refreshed = 0.0

    def by_node(self, keys: Sequence[str]) -> dict[Address, list[int]]:
        """The indices of `keys`, grouped by the master that serves each."""
        nodes = self.client.nodes_manager
        groups: dict[Address, list[int]] = {}
        for i, key in enumerate(keys):
            node = nodes.get_node_from_slot(key_slot(key.encode()))
            groups.setdefault((node.host, int(node.port)), []).append(i)
        return groups

    def refresh(self) -> None:
        """Re-read the slot map (after a node failed), unless that was done just now."""
        with self._lock:
            now = time.monotonic()
            if now - self._refreshed < REFRESH_MIN_S:
                return
            self._refreshed = now
        with suppress(redis.RedisError):  # no node answers now: the next failure tries again
            self.client.nodes_manager.initialize()


def is_redirect(message: str) -> bool:
    """Whether an error reply means "ask another node / later" rather than a real failure."""
    return message.startswith(REDIRECTS)


def connect_kwargs(client: redis.Redis | RedisCluster) -> dict[str, Any]:
    """The connection settings (credentials, db) redis-py uses for `client`'s nodes."""
    if isinstance(client, RedisCluster):
        node = client.get_default_node()
        return dict(node.redis_connection.connection_pool.connection_kwargs)
    return dict(client.connection_pool.connection_kwargs)
