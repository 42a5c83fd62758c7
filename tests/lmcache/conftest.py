"""Real services for the LMCache connector tests: a redis-server and LMCache's own `lm://`
server, each a child process on a free loopback port, killed at the end
(tests/helpers/kvx_test_services.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from kvx_test_services import RedisProcess, lmcache_server

# LMCache phones home usage statistics unless told not to (the connector sets this too; the
# servers started here inherit it).
os.environ["LMCACHE_TRACK_USAGE"] = "false"


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A redis-server of this test's own (an empty store), without persistence."""
    server = RedisProcess()
    try:
        yield f"redis://127.0.0.1:{server.port}"
    finally:
        server.kill()


@pytest.fixture
def lm_url() -> Iterator[str]:
    """LMCache's own KV server on loopback, of this test's own."""
    with lmcache_server() as url:
        yield url
