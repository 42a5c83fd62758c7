"""xPyD service discovery for P2pNcclConnector: a server whose config names a proxy
(`proxy_ip`, `proxy_port`, `http_port`, vLLM's keys) announces itself to `kvx proxy
--discovery-port` by heartbeat (`kvx.discovery.Announcer`).

The announcement carries the role (`kv_producer` and `kv_both` announce as P, as in vLLM; a
`kv_consumer` as D), the HTTP address `kv_ip:http_port` (so the proxy must reach `vllm serve`
at `kv_ip`) and the KV address `kv_ip:kv_port` (rank 0's ZMQ listener; none with `kv_port` 0),
which the proxy passes to P as `kv_transfer_params.decode_address`. With `shared_secret` the
heartbeats are sealed with it; the proxy needs the same secret (`--discovery-secret-file`). One
announcer per server: the scheduler side starts it (one per engine, whatever its TP) and stops
it on shutdown.
"""

from __future__ import annotations

from kvx import KVTransferConfig, resolve_secret
from kvx.discovery import Announcer
from kvx.plugins.p2p.addresses import format_address
from kvx.plugins.p2p.config import SECRET_KEY, P2pConfig


def start_announcer(options: P2pConfig, config: KVTransferConfig) -> Announcer | None:
    """The running heartbeat of this server, or None when no proxy is configured."""
    if options.proxy_ip is None or options.proxy_port is None or options.http_port is None:
        return None  # P2pConfig has checked that proxy_ip comes with the two ports
    return Announcer(
        format_address(options.proxy_ip, options.proxy_port),
        "P" if config.is_kv_producer else "D",
        format_address(config.kv_ip, options.http_port),
        # kv_port 0 (GET: each worker on a port of its own, named in P's answers): no fixed
        # address to push to, so none is announced
        format_address(config.kv_ip, config.kv_port) if config.kv_port else "",
        secret=resolve_secret(options.shared_secret, SECRET_KEY, min_length=8),
    ).start()
