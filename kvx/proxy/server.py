"""Running the proxy: `serve` blocks (the CLI), `serve_in_thread` runs it beside the caller
(tests, benchmarks). Both bind the listening socket first, so a busy port or an unknown host
is a clear `ProxySettingError` before anything starts."""

from __future__ import annotations

import errno
import resource
import socket
import threading
import time
from collections.abc import Callable

import uvicorn

from kvx.discovery import BackgroundService
from kvx.errors import ConfigProblem
from kvx.proxy.app import build_app
from kvx.proxy.config import ProxyConfig, ProxySettingError
from kvx.proxy.connections import guarded_protocol
from kvx.proxy.discovery import DiscoveryListener, DiscoverySettings
from kvx.proxy.pool import ServerPool
from kvx.proxy.relay import quiet_cut_streams

GRACEFUL_SHUTDOWN_S = 5
"""How long open requests may finish after a stop is asked for."""


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening (port 0: a free port)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ProxySettingError(
            [ConfigProblem("--host", f"{host!r} cannot be resolved: {exc.strerror}")]
        ) from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        flag = "--host" if exc.errno == errno.EADDRNOTAVAIL else "--port"
        raise ProxySettingError(
            [ConfigProblem(flag, f"cannot listen on {host}:{port}: {exc.strerror}")]
        ) from None
    return sock


def listening_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def start_discovery(config: ProxyConfig, pool: ServerPool) -> DiscoveryListener | None:
    """The discovery listener the config asks for, listening and serving; None if none."""
    if config.discovery_port is None:
        return None
    settings = DiscoverySettings(
        host=config.discovery_host,
        port=config.discovery_port,
        timeout_s=config.discovery_timeout,
        max_servers=config.discovery_max_servers,
        secret=config.discovery_secret,
    )
    return DiscoveryListener(pool, settings).start()


def connection_limit(wanted: int) -> int:
    """`wanted` open client connections, at most a third of this process's descriptor limit
    (each client connection may need one to P and one to D)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, (soft - 64) // 3))


def _server(
    config: ProxyConfig, pool: ServerPool, discovery: DiscoveryListener | None
) -> uvicorn.Server:
    app = build_app(config, pool)
    app.state.discovery = discovery
    quiet_cut_streams()
    return uvicorn.Server(
        uvicorn.Config(
            app,
            http=guarded_protocol(config.header_timeout, connection_limit(config.max_connections)),
            lifespan="on",
            log_config=None,  # keep the host program's logging as it is
            access_log=False,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
    )


def serve(
    config: ProxyConfig,
    *,
    pool: ServerPool | None = None,
    on_listening: Callable[[str, str | None], None] | None = None,
) -> None:
    """Run the proxy until SIGINT/SIGTERM. `on_listening` gets its URL and the discovery
    listener's host:port (None without discovery) once both listen (connections made from then
    on wait for the proxy to accept them)."""
    sock = bind_listener(config.host, config.port)
    pool = pool if pool is not None else ServerPool(config.prefill, config.decode)
    try:
        discovery = start_discovery(config, pool)
    except ProxySettingError:
        sock.close()
        raise
    if on_listening is not None:
        on_listening(listening_url(sock), discovery.address if discovery else None)
    try:
        _server(config, pool, discovery).run(sockets=[sock])
    finally:
        sock.close()
        if discovery is not None:
            discovery.stop()


class RunningProxy(BackgroundService):
    """A proxy serving from a background thread; `stop()` (or leaving the `with`) ends it."""

    def __init__(self, config: ProxyConfig, pool: ServerPool | None, start_timeout: float) -> None:
        self.pool = pool if pool is not None else ServerPool(config.prefill, config.decode)
        self._sock = bind_listener(config.host, config.port)
        self.url = listening_url(self._sock)
        try:
            self.discovery = start_discovery(config, self.pool)
        except ProxySettingError:
            self._sock.close()
            raise
        self._server = _server(config, self.pool, self.discovery)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="kvx-proxy", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + start_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvx proxy on {self.url} did not start in {start_timeout} s")
            time.sleep(0.01)

    def stop(self, timeout: float = GRACEFUL_SHUTDOWN_S + 5) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()
        if self.discovery is not None:
            self.discovery.stop()
        if self._thread.is_alive():
            raise RuntimeError(f"kvx proxy on {self.url} did not stop within {timeout} s")


def serve_in_thread(
    config: ProxyConfig, *, pool: ServerPool | None = None, start_timeout: float = 30.0
) -> RunningProxy:
    """Start the proxy in a background thread and return once it accepts requests."""
    return RunningProxy(config, pool, start_timeout)
