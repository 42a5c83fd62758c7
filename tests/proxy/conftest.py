"""Fixtures for the proxy's tests: stub upstream servers (real HTTP on loopback, standing in for
vLLM; see upstream_server.py), a proxy serving in a thread of the test, and an HTTP client."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from kvx.proxy import ProxyConfig, RunningProxy, serve_in_thread

UPSTREAM_SCRIPT = Path(__file__).with_name("upstream_server.py")


def _load_upstream() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvx_proxy_test_upstream", UPSTREAM_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


upstream = _load_upstream()


@pytest.fixture
def stub() -> Iterator[Callable[[str], Any]]:
    """`stub(name)` starts a stub server in this process; all are stopped after the test."""
    started: list[Any] = []

    def start(name: str) -> Any:
        server = upstream.StubServer(name)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def free_port() -> int:
    with upstream.listener(0) as sock:
        return int(sock.getsockname()[1])


@pytest.fixture
def stub_process() -> Iterator[Callable[[str, int], subprocess.Popen[str]]]:
    """`stub_process(name, port)` starts a stub server in its own process (so a test can kill
    it for real) and returns once it listens; all are killed after the test."""
    started: list[subprocess.Popen[str]] = []

    def start(name: str, port: int) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, str(UPSTREAM_SCRIPT), "--port", str(port), "--name", name],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        started.append(process)
        assert process.stdout is not None
        line = process.stdout.readline()  # the script prints it once its socket listens
        assert f"serving on {port}" in line, f"stub {name} did not start: {line!r}"
        return process

    yield start
    for process in started:
        process.kill()
        process.wait(10)


@pytest.fixture
def start_proxy() -> Iterator[Callable[..., RunningProxy]]:
    """`start_proxy(prefill=[...], decode=[...], **settings)` serves a proxy on a free loopback
    port (health checks every 0.1 s unless told otherwise); all are stopped after the test."""
    running: list[RunningProxy] = []

    def start(prefill: list[str], decode: list[str], **settings: Any) -> RunningProxy:
        settings.setdefault("health_interval", 0.1)
        settings.setdefault("health_timeout", 5.0)
        settings.setdefault("request_timeout", 10.0)
        config = ProxyConfig(prefill=tuple(prefill), decode=tuple(decode), port=0, **settings)
        proxy = serve_in_thread(config)
        running.append(proxy)
        return proxy

    yield start
    for proxy in running:
        proxy.stop()


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=15.0, trust_env=False) as http:
        yield http


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(name="free_port")
def free_port_fixture() -> Callable[[], int]:
    return free_port


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[[Callable[[], bool], float, str], None]:
    return wait_until
