"""`kvx proxy` on the command line: flag errors (exit 2 naming the flag, the value and what is
allowed), a busy port, the loopback default, and a real request through the console script.

The upstream servers are small real HTTP servers on loopback ports standing in for vLLM
(tests/proxy/upstream_server.py); the real `vllm serve` P/D runs belong to tests/vllm.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import kvx
from kvx.cli.commands import main

pytestmark = pytest.mark.timeout(90)

KVX = shutil.which("kvx", path=str(Path(sys.executable).parent))
P, D = "http://127.0.0.1:8100", "http://127.0.0.1:8200"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--decode", D],
            "--prefill: at least one server URL is required (repeat --prefill for more)",
        ),
        (
            ["--prefill", P, "--decode", D, "--routing", "random"],
            '--routing: "random" is not a routing policy; allowed: "round_robin", '
            '"least_outstanding"',
        ),
        (
            ["--prefill", P, "--decode", D, "--routing", "least-outstanding"],
            '(did you mean "least_outstanding"?)',
        ),
        (["--prefill", P, "--decode", D, "--port", "abc"], '--port: "abc" is not an integer'),
        (
            ["--prefill", P, "--decode", D, "--port", "70000"],
            "--port: 70000 is not allowed; expected an integer in 0-65535",
        ),
        (
            ["--prefill", P, "--decode", D, "--request-timeout", "0"],
            "--request-timeout: 0.0 is not allowed; expected seconds > 0",
        ),
        (
            ["--prefill", P, "--decode", D, "--health-interval", "nan"],
            "--health-interval: NaN is not allowed; expected seconds > 0",
        ),
        (
            ["--prefill", P, "--decode", D, "--health-timeout", "soon"],
            '--health-timeout: "soon" is not a number of seconds',
        ),
        (
            ["--prefill", P, "--decode", D, "--max-body-bytes", "-1"],
            "--max-body-bytes: -1 is not allowed; expected an integer in 1-1073741824",
        ),
        (
            ["--prefill", "localhost:8100", "--decode", D],
            '--prefill: "localhost:8100": expected http://HOST:PORT or https://HOST:PORT',
        ),
        (
            ["--prefill", P, "--decode", "http://127.0.0.1:8200/v1"],
            '--decode: "http://127.0.0.1:8200/v1": expected the server\'s root URL without a '
            "path (the proxy adds /v1/...), got path '/v1'",
        ),
        (
            ["--prefill", P, "--prefill", P + "/", "--decode", D],
            '--prefill: "http://127.0.0.1:8100/" is given twice',
        ),
    ],
)
def test_bad_flag_exits_2_naming_flag_value_and_what_is_allowed(flags, message, capsys):
    assert main(["proxy", *flags]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.err.startswith("error: invalid proxy setting")
    assert "Traceback" not in captured.err


def test_every_bad_flag_is_reported_at_once(capsys):
    assert main(["proxy", "--port", "x", "--routing", "y", "--max-body-bytes", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid proxy settings (5 problems):")
    for flag in ("--prefill", "--decode", "--port", "--routing", "--max-body-bytes"):
        assert f"  - {flag}: " in err


WITHOUT_EXTRA = """
import sys
for name in ("starlette", "httpx", "uvicorn"):
    sys.modules[name] = None  # as if the proxy extra were not installed: importing it fails
import kvx
from kvx.cli.commands import main
sys.exit(main(sys.argv[1:]))
"""


def run_without_extra(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRA, "proxy", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_without_the_extra_flags_are_checked_and_starting_says_how_to_install():
    assert run_without_extra("--help").returncode == 0
    bad = run_without_extra("--prefill", P, "--decode", D, "--port", "x")
    assert bad.returncode == 2
    assert bad.stderr == 'error: invalid proxy setting: --port: "x" is not an integer\n'
    start = run_without_extra("--prefill", P, "--decode", D)
    assert start.returncode == 1
    assert start.stderr == (
        "error: kvx proxy needs the 'proxy' extra (starlette, httpx, uvicorn not installed): "
        f"{kvx.install_hint('proxy', 'starlette')}\n"
    )


def test_busy_port_exits_2_with_the_reason():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [KVX, "proxy", "--prefill", P, "--decode", D, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"error: invalid proxy setting: --port: cannot listen on 127.0.0.1:{port}: "
        "Address already in use\n"
    )


def test_a_bad_kvx_otel_value_exits_2_naming_it_and_what_is_allowed():
    env = {**os.environ, "KVX_OTEL": "maybe"}
    done = subprocess.run(
        [KVX, "proxy", "--prefill", P, "--decode", D, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        "error: KVX_OTEL: 'maybe' is not allowed; use 1, true or yes (on) or 0, false, no (off)\n"
    )


def listening_address(port: int) -> str:
    """The local address of the listening TCP socket on `port`, from /proc/net/tcp."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        address, port_hex = fields[1].split(":")
        if int(port_hex, 16) == port and fields[3] == "0A":  # 0A: LISTEN
            return socket.inet_ntoa(bytes.fromhex(address)[::-1])
    raise AssertionError(f"nothing listens on port {port}")


def start_cli_proxy(*flags: str) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [KVX, "proxy", *flags, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("kvx proxy listening on http://"), line + process.stderr.read()
    return process, line.split()[4]


def test_cli_proxy_listens_on_loopback_serves_and_stops_on_sigterm(stub, client):
    p, d = stub("P"), stub("D")
    process, url = start_cli_proxy("--prefill", p.url, "--decode", d.url)
    try:
        port = int(url.rsplit(":", 1)[1])
        assert url == f"http://127.0.0.1:{port}"
        assert listening_address(port) == "127.0.0.1"
        answer = client.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["text"] == "decoded by D"
        assert p.behaviour.completions()[0].body["max_tokens"] == 1
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    # Open requests finish, then the process ends by the signal it was sent.
    assert "Application shutdown complete" in err
    assert process.returncode == -signal.SIGTERM, err


def test_cli_host_flag_is_honoured(stub):
    p, d = stub("P"), stub("D")
    process, url = start_cli_proxy("--prefill", p.url, "--decode", d.url, "--host", "0.0.0.0")
    try:
        assert listening_address(int(url.rsplit(":", 1)[1])) == "0.0.0.0"
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)
    assert process.returncode == -signal.SIGTERM
