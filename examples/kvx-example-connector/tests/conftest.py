"""What the kvx conformance kit needs from this package's tests: the connector configs under
test (`kvx_config`) and the service one of them uses, a real redis-server."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

EXAMPLE = {
    "kv_connector": "ExamplePDConnector",
    "kv_connector_extra_config": {"directory": "{tmp}", "load_timeout_s": 5},
}


def _redis_command(port: int, command: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
        sock.sendall(command)
        return sock.recv(64)


@pytest.fixture(scope="session")
def redis_port() -> Iterator[int]:
    """A private redis-server on a free loopback port, without persistence."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: apt-get install -y redis-server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    server = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if _redis_command(port, b"PING\r\n").startswith(b"+PONG"):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                pytest.fail(f"redis-server on port {port} did not start")
            time.sleep(0.05)
        yield port
    finally:
        server.kill()
        server.wait(timeout=10)


@pytest.fixture
def redis_url(redis_port: int) -> str:
    """The server's URL, emptied for each test."""
    _redis_command(redis_port, b"FLUSHDB\r\n")
    return f"redis://127.0.0.1:{redis_port}/0"


@pytest.fixture
def kvx_config(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The config under test: the example connector alone, or (on a class that sets
    `with_redis_store`) composed with kvx's shared-storage connector on the Redis server."""
    if not getattr(request.cls, "with_redis_store", False):
        return EXAMPLE
    store = {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {"storage_url": request.getfixturevalue("redis_url")},
    }
    return {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {"connectors": [EXAMPLE, store]},
    }
