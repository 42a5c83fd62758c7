"""D's handshakes with P engines (split out of `worker.py`): each request's first handshake with
an engine runs on a background pool and is polled each step; the pre-connections made at start-up
(`preconnect.py`) add their engines under the worker's lock. Both end in `remotes`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvx.plugins.nixl.config import NixlConfig
from kvx.plugins.nixl.metadata import RemoteRead
from kvx.plugins.nixl.preconnect import Fetched, Preconnector, fetch_address
from kvx.plugins.nixl.remote import LocalView, RemoteEngine, build_remote, fetch_remote
from kvx.plugins.nixl.stats import NixlKVConnectorStats

logger = logging.getLogger(__name__)

HandshakeKey = tuple[str, str, int, int, int]
"""P's engine id, side-channel host and port, TP size, PP size."""


def handshake_key(spec: RemoteRead) -> HandshakeKey:
    return (
        spec.remote_engine_id,
        spec.remote_host,
        spec.remote_port,
        spec.remote_tp_size,
        spec.remote_pp_size,
    )


class Peers:
    """The P engines one D worker has handshaken with (`remotes`) and the handshakes in flight;
    `start_read` / `fail` take a request once its engine's handshake succeeded / failed."""

    def __init__(
        self,
        agent: Any,
        lock: threading.Lock,
        options: NixlConfig,
        secret: str | None,
        stats: NixlKVConnectorStats,
        start_read: Callable[[RemoteRead, RemoteEngine], None],
        fail: Callable[[RemoteRead, list[int]], None],
    ) -> None:
        self.remotes: dict[HandshakeKey, RemoteEngine] = {}
        self._agent, self._lock, self._options, self._secret, self._stats = (
            agent,
            lock,
            options,
            secret,
            stats,
        )
        self._start_read, self._fail = start_read, fail
        self._view: LocalView | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._handshakes: dict[HandshakeKey, tuple[Future, list[RemoteRead]]] = {}
        self._preconnector: Preconnector | None = None

    def bind(self, view: LocalView, preconnect: list[tuple[str, int]]) -> None:
        """The registered cache's view; pre-connect to `preconnect` (host, port) in a thread."""
        self._view = view
        if preconnect:
            self._preconnector = Preconnector(preconnect, self._fetch_address, self._connect)

    def enqueue(self, spec: RemoteRead) -> None:
        """Start the read if P's engine is known, else handshake with it first."""
        key = handshake_key(spec)
        remote = self.remotes.get(key)
        if remote is not None:
            self._start_read(spec, remote)
            return
        if key in self._handshakes:
            self._handshakes[key][1].append(spec)
            return
        assert self._view is not None, "register_kv_caches must run before loads"
        self._stats.count("num_handshakes")
        o = self._options
        future = self.submit(
            fetch_remote,
            self._view,
            spec,
            timeout_s=o.handshake_timeout_s,
            max_bytes=o.max_handshake_bytes,
            secret=self._secret,
            enforce_compat=o.enforce_handshake_compat,
        )
        self._handshakes[key] = (future, [spec])

    def submit(self, fn: Any, *args: Any, **kwargs: Any) -> Future:
        """Run `fn` on the background pool (handshakes, P's digests), made on first use."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvx-nixl-handshake")
        return self._pool.submit(fn, *args, **kwargs)

    def progress(self) -> None:
        """Take the handshakes that ended: start their reads, or fail them."""
        for key, (future, specs) in list(self._handshakes.items()):
            if not future.done():
                continue
            del self._handshakes[key]
            try:
                assert self._view is not None
                remote = build_remote(
                    self._view,
                    future.result(),
                    self._agent.add_remote_agent,
                    self._agent.remove_remote_agent,
                )
            except Exception as exc:  # an untrusted peer: whatever went wrong, fail its reads
                logger.error("handshake with engine %s failed: %s", key[0], exc)
                self._stats.count("num_failed_handshakes")
                for spec in specs:
                    self._fail(spec, spec.local_block_ids)
                continue
            self.remotes[key] = remote
            for spec in specs:
                self._start_read(spec, remote)

    def _fetch_address(self, host: str, port: int) -> Fetched:
        assert self._view is not None
        o = self._options
        return fetch_address(
            self._view,
            host,
            port,
            timeout_s=o.handshake_timeout_s,
            max_bytes=o.max_handshake_bytes,
            secret=self._secret,
            enforce_compat=o.enforce_handshake_compat,
        )

    def _connect(self, fetched: Fetched) -> None:
        """Preconnect (its thread): add P's agents and wire up UCX to each, unless a request
        got there first."""
        spec, metas = fetched
        key = handshake_key(spec)
        with self._lock:
            if self._agent is None or key in self.remotes or key in self._handshakes:
                return
            assert self._view is not None
            remote = build_remote(
                self._view, metas, self._agent.add_remote_agent, self._agent.remove_remote_agent
            )
            self.remotes[key] = remote
            for agent in remote.agents.values():
                try:
                    self._agent.make_connection(agent)
                except Exception as exc:  # the first READ connects instead
                    logger.warning("pre-connecting UCX to %s failed: %s", agent, exc)
            self._stats.count("num_preconnects")
        logger.info("pre-connected to engine %s at %s:%d", key[0], key[1], key[2])

    def stop_preconnect(self) -> None:
        """Stop pre-connecting; call without the lock (the thread may be waiting for it)."""
        if self._preconnector is not None:
            self._preconnector.close()
            self._preconnector = None

    def stop(self) -> None:
        """Shut the pool (waiting for a running task) and forget the handshakes in flight."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._handshakes.clear()

    def release(self) -> None:
        """Remove every engine's agents (once the reads from them are released)."""
        for remote in self.remotes.values():
            remote.release(self._agent)
        self.remotes.clear()
        self._agent = None
