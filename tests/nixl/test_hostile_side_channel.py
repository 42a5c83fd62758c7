"""A peer an attacker runs against the NIXL side channel. With a shared secret the side
channel is a ZMQ CURVE server (keys derived from the secret): the issue's reproducer (one
message of 4,000,000 one-byte frames) from a peer without the secret fails the handshake and
libzmq queues none of it, and a legitimate handshake is served meanwhile. Without a secret such
a message is read and dropped frame by frame, one warning for a flood of them (rate-limited
like refusals); libzmq's own queue (~64 bytes a frame) is beyond the server's reach.

KVX_NIXL_FRAMES (default 4,000,000, the issue's reproducer) sets the frame count with a secret;
without one the test sends a quarter of it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from kvx.plugins.nixl.handshake import compatibility_factors, compatibility_hash
from kvx.plugins.nixl.side_channel import SideChannelServer, fetch_payload

from .test_handshake import agent_meta, context

pytestmark = pytest.mark.timeout(240)

SECRET = "hostile-side-channel"
FRAMES = int(os.environ.get("KVX_NIXL_FRAMES", "4000000"))
ATTACKER = """
import socket, sys, time
port, frames = int(sys.argv[1]), int(sys.argv[2])
# ZMTP 3.0 by hand (a NULL-mechanism DEALER): greeting, READY, then messages of empty frames
raw = socket.create_connection(("127.0.0.1", port), timeout=30)
ready = b"\\x05READY\\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
try:
    raw.sendall(b"\\xff" + bytes(8) + b"\\x7f\\x03\\x00" + b"NULL".ljust(20, b"\\0") + bytes(32))
    raw.sendall(b"\\x04" + bytes([len(ready)]) + ready)
    for count in (frames, 5, 7, 2):
        raw.sendall(b"\\x01\\x00" * (count - 1) + b"\\x00\\x00")
except OSError as exc:  # a CURVE server hangs up on a NULL greeting
    print("refused:", exc, file=sys.stderr)
print("sent", flush=True)
time.sleep(120)
"""


def status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field}")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "no-secret"])
def test_a_message_of_millions_of_frames_is_dropped_and_a_handshake_still_served(
    caplog, secret: str | None
) -> None:
    caplog.set_level(logging.WARNING)
    frames = FRAMES if secret is not None else FRAMES // 4  # read frame by frame: 2 s a million
    factors = compatibility_factors(context())
    server = SideChannelServer(
        "127.0.0.1", 0, compatibility_hash(factors), factors, {(0, 0): agent_meta()}, secret
    )
    attacker = None
    try:
        reset_peak()
        before = status_mib("VmHWM")
        attacker = subprocess.Popen(  # its own process: its send queue is not counted here
            [sys.executable, "-c", ATTACKER, str(server.port), str(frames)],
            stdout=subprocess.PIPE,
        )
        assert attacker.stdout is not None and attacker.stdout.readline() == b"sent\n"
        if secret is None:  # the messages reach the server: wait for them
            deadline = time.monotonic() + 120
            while server.refused < 4:
                assert time.monotonic() < deadline, f"{server.refused} of 4 messages dropped"
                time.sleep(0.1)
        start = time.monotonic()
        payload = fetch_payload(
            "127.0.0.1", server.port, 0, 0, timeout_s=10, max_bytes=1 << 16, secret=secret
        )
        assert payload.agent_metadata_bytes == agent_meta()
        assert time.monotonic() - start < 10
        growth = status_mib("VmHWM") - before
        libzmq = 0 if secret else frames * 64 / (1 << 20)
        assert growth <= libzmq + 64, f"grew {growth:.0f} MiB; libzmq's queue is {libzmq:.0f}"
    finally:
        if attacker is not None:
            attacker.kill()
            attacker.wait(10)
        server.close()
    warnings = [r.getMessage() for r in caplog.records if "side channel" in r.getMessage()]
    if secret is None:
        assert len(warnings) == 1, warnings  # four bad messages, one line
        assert f"a message of {frames + 1} frames" in warnings[0], warnings
    else:
        assert not warnings and server.refused == 0, "an unauthenticated message got through"
    assert not [r for r in caplog.records if r.exc_info]
