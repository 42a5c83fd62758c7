"""Real servers for the serving tests: `vllm serve` prefill/decode/plain servers, `kvx proxy` and
`redis-server`, each started in its own process group (optionally inside a network namespace),
waited for with a deadline, logged to a file whose tail goes into every failure message, and
torn down (SIGTERM to the whole group, then SIGKILL) however the test ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

BIN = Path(sys.executable).parent  # .venv-vllm/bin: `vllm`, `kvx`
LIVE: list[Server] = []  # every running server, for the failure report (conftest.py)

SERVER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOG_STATS_INTERVAL": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
SERVE_OPTIONS = [
    "--dtype=float32",
    "--enforce-eager",
    "--max-num-seqs=4",
    "--seed=0",
    "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def netns_prefix(netns: str | None) -> list[str]:
    """Run a command inside `netns` (`ip netns exec` also gives it a fresh /sys, so UCX sees the
    namespace's interfaces)."""
    return ["ip", "netns", "exec", netns] if netns else []


class Server:
    """One server process group with its log."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        netns: str | None = None,
    ) -> None:
        self.name = name
        self.argv = [*netns_prefix(netns), *argv]
        self.log = log_dir / f"{name}.log"
        full_env = {**os.environ, **SERVER_ENV, **(env or {})}
        full_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # set for the in-process tests
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                start_new_session=True,  # its own process group: teardown reaches every child
            )
        LIVE.append(self)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 60) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text[-lines:])

    def failure(self, what: str) -> RuntimeError:
        state = "running" if self.alive else f"exited with {self.proc.returncode}"
        return RuntimeError(
            f"{self.name}: {what} ({state}; argv {' '.join(self.argv)}); last log lines of "
            f"{self.log}:\n{self.tail()}"
        )

    def wait_until(self, ready: Callable[[], bool], what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive:
                raise self.failure(f"exited while waiting for {what}")
            try:
                if ready():
                    return
            except (OSError, httpx.HTTPError):
                pass
            time.sleep(0.5)
        raise self.failure(f"not {what} after {timeout_s:.0f} s")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (a server's engine core is its child)."""
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, grace_s: float = 15.0) -> None:
        self.kill(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(grace_s)
        with contextlib.suppress(ProcessLookupError):  # children outliving their parent
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.alive:
            self.proc.wait(10)
        if self in LIVE:
            LIVE.remove(self)


class HttpServer(Server):
    """A server with an HTTP base URL and a health endpoint."""

    def __init__(self, name: str, argv: Sequence[str], url: str, log_dir: Path, **kw: Any):
        super().__init__(name, argv, log_dir, **kw)
        self.url = url

    def wait_healthy(self, timeout_s: float, client_netns: str | None = None) -> None:
        if client_netns:  # the test process cannot reach a namespace's address
            probe = f"import urllib.request as u; u.urlopen('{self.url}/health', timeout=2)"
            check = [*netns_prefix(client_netns), sys.executable, "-c", probe]

            def ready() -> bool:
                return subprocess.run(check, capture_output=True).returncode == 0

            self.wait_until(ready, "healthy", timeout_s)
        else:
            self.wait_until(
                lambda: httpx.get(f"{self.url}/health", timeout=2).status_code == 200,
                "healthy",
                timeout_s,
            )


def vllm_server(
    name: str,
    model: Path,
    log_dir: Path,
    kv_config: dict[str, Any] | None,
    core: str,
    max_model_len: int,
    host: str = "127.0.0.1",
    netns: str | None = None,
    env: dict[str, str] | None = None,
    extra: Sequence[str] = (),
    port: int | None = None,
) -> HttpServer:
    """`vllm serve` pinned to `core` (VLLM_CPU_OMP_THREADS_BIND: two servers on one host must not
    share cores, or one waits for the other's threads and its KV reads time out), on `port`
    (default: a free one)."""
    port = port or free_port()
    argv = [
        str(BIN / "vllm"),
        "serve",
        str(model),
        f"--host={host}",
        f"--port={port}",
        f"--max-model-len={max_model_len}",
        f"--served-model-name={model.name}",
        *SERVE_OPTIONS,
        *extra,
    ]
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config)]
    server_env = {"VLLM_CPU_OMP_THREADS_BIND": core, **(env or {})}
    return HttpServer(name, argv, f"http://{host}:{port}", log_dir, env=server_env, netns=netns)


def proxy_server(
    log_dir: Path,
    prefills: Sequence[str],
    decodes: Sequence[str],
    host: str = "127.0.0.1",
    netns: str | None = None,
    extra: Sequence[str] = (),
    name: str = "proxy",
) -> HttpServer:
    port = free_port()
    argv = [str(BIN / "kvx"), "proxy", f"--host={host}", f"--port={port}", *extra]
    for url in prefills:
        argv += ["--prefill", url]
    for url in decodes:
        argv += ["--decode", url]
    return HttpServer(name, argv, f"http://{host}:{port}", log_dir, netns=netns)


def redis_server(log_dir: Path, host: str = "127.0.0.1", netns: str | None = None) -> Server:
    """A throw-away redis-server (no persistence). In a namespace it listens on `host` for the
    other namespace's clients: protected mode would refuse those without a password."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (`make system-deps` installs it)")
    port = free_port()
    argv = [exe, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no"]
    argv += ["--protected-mode", "no" if netns else "yes"]
    server = Server("redis", argv, log_dir, netns=netns)
    server.url = f"redis://{host}:{port}"  # type: ignore[attr-defined]
    ping = [*netns_prefix(netns), "redis-cli", "-h", host, "-p", str(port), "ping"]
    server.wait_until(
        lambda: subprocess.run(ping, capture_output=True, text=True).stdout.strip() == "PONG",
        "answering PING",
        20,
    )
    return server
