"""P2pNcclConnector's side of xPyD discovery (`kvx.plugins.p2p.discovery`): a server configured
with vLLM's `proxy_ip`/`proxy_port`/`http_port` announces its role, `kv_ip:http_port` and
`kv_ip:kv_port` to a real discovery listener, sealed with `shared_secret` when it is set."""

from __future__ import annotations

from typing import Any

import pytest

from kvx import KVTransferConfig
from kvx.plugins.p2p.config import P2pConfig
from kvx.plugins.p2p.discovery import start_announcer
from kvx.proxy import ServerPool
from kvx.proxy.discovery import DiscoveryListener, DiscoverySettings

pytestmark = pytest.mark.timeout(60)


def p2p_config(role: str, kv_port: int, **extra: Any) -> KVTransferConfig:
    return KVTransferConfig.from_dict(
        {
            "kv_connector": "P2pNcclConnector",
            "kv_role": role,
            "kv_ip": "127.0.0.1",
            "kv_port": kv_port,
            "kv_connector_extra_config": extra,
        }
    )


def announce(listener: DiscoveryListener, role: str, kv_port: int, **extra: Any) -> Any:
    host, port = listener.address.rsplit(":", 1)
    config = p2p_config(role, kv_port, proxy_ip=host, proxy_port=int(port), **extra)
    announcer = start_announcer(config.extra_config_as(P2pConfig), config)
    assert announcer is not None
    announcer.interval_s = 0.1
    return announcer


@pytest.mark.parametrize(("role", "as_"), [("kv_producer", "prefill"), ("kv_consumer", "decode")])
def test_a_configured_server_announces_its_role_http_and_kv_address(role, as_, wait_until):
    pool = ServerPool()
    with DiscoveryListener(pool, DiscoverySettings(port=0)) as listener:
        announcer = announce(listener, role, 21001, http_port=8100)
        try:
            wait_until(lambda: len(pool.servers()) == 1, 10, "the server to join")
            server = pool.servers()[0]
            assert (server.role, server.url, server.kv_address) == (
                as_,
                "http://127.0.0.1:8100",
                "127.0.0.1:21001",
            )
        finally:
            announcer.stop()
        wait_until(lambda: not pool.servers(), 5, "the server to leave on stop")


def test_with_shared_secret_only_a_proxy_with_that_secret_accepts_it(wait_until):
    secret = "p2p-shared-secret"
    sealed_pool, open_pool = ServerPool(), ServerPool()
    with (
        DiscoveryListener(sealed_pool, DiscoverySettings(port=0, secret=secret)) as sealed,
        DiscoveryListener(open_pool, DiscoverySettings(port=0)) as unsealed,
    ):
        a = announce(sealed, "kv_consumer", 22001, http_port=8200, shared_secret=secret)
        b = announce(unsealed, "kv_consumer", 22001, http_port=8200, shared_secret=secret)
        try:
            wait_until(lambda: len(sealed_pool.servers()) == 1, 10, "the sealed D to join")
            wait_until(lambda: unsealed.counts.refused >= 1, 10, "the unsealing proxy to refuse")
            assert not open_pool.servers()  # a tag in front of msgpack does not decode
        finally:
            a.stop()
            b.stop()


def test_without_proxy_ip_nothing_is_announced():
    config = p2p_config("kv_producer", 21001)
    assert start_announcer(config.extra_config_as(P2pConfig), config) is None


def test_with_kv_port_0_no_kv_address_is_announced(wait_until):
    pool = ServerPool()
    with DiscoveryListener(pool, DiscoverySettings(port=0)) as listener:
        announcer = announce(listener, "kv_producer", 0, http_port=8100, send_type="GET")
        try:
            wait_until(lambda: len(pool.servers()) == 1, 10, "P to join")
            assert pool.servers()[0].kv_address is None  # P2P workers' ports are ephemeral
        finally:
            announcer.stop()
