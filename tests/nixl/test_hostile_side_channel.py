"""A peer an attacker runs against the NIXL side channel (a shared secret set): a message of a
million tiny frames is dropped without holding them all in Python, one warning for a flood of
them (rate-limited like refusals), and a legitimate handshake is still served after it.

KVX_NIXL_FRAMES (default 1,000,000) sets the frame count; the issue's reproducer is 4,000,000.
libzmq itself queues a whole multipart message (~64 bytes a frame) before any frame of it can
be read: that memory is beyond the server's reach."""

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
FRAMES = int(os.environ.get("KVX_NIXL_FRAMES", "1000000"))
ATTACKER = """
import sys, time, zmq
socket = zmq.Context().socket(zmq.DEALER)
socket.connect("tcp://127.0.0.1:" + sys.argv[1])
for frames in (int(sys.argv[2]), 5, 7, 2):
    socket.send_multipart([b""] * frames)
print("sent", flush=True)
time.sleep(120)
"""


def status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field}")


def test_a_message_of_a_million_frames_is_dropped_and_a_handshake_still_served(caplog) -> None:
    caplog.set_level(logging.WARNING)
    factors = compatibility_factors(context())
    server = SideChannelServer(
        "127.0.0.1", 0, compatibility_hash(factors), factors, {(0, 0): agent_meta()}, SECRET
    )
    attacker = None
    try:
        before = status_mib("VmRSS")
        attacker = subprocess.Popen(  # its own process: its send queue is not counted here
            [sys.executable, "-c", ATTACKER, str(server.port), str(FRAMES)],
            stdout=subprocess.PIPE,
        )
        assert attacker.stdout is not None and attacker.stdout.readline() == b"sent\n"
        deadline = time.monotonic() + 120
        while server.refused < 4:
            assert time.monotonic() < deadline, f"{server.refused} of 4 messages dropped"
            time.sleep(0.1)
        start = time.monotonic()
        payload = fetch_payload(
            "127.0.0.1", server.port, 0, 0, timeout_s=10, max_bytes=1 << 16, secret=SECRET
        )
        assert payload.agent_metadata_bytes == agent_meta()
        assert time.monotonic() - start < 10
        growth = status_mib("VmHWM") - before
        libzmq = FRAMES * 64 / (1 << 20)
        assert growth <= libzmq + 64, f"grew {growth:.0f} MiB; libzmq's queue is {libzmq:.0f}"
    finally:
        if attacker is not None:
            attacker.kill()
            attacker.wait(10)
        server.close()
    warnings = [r.getMessage() for r in caplog.records if "side channel" in r.getMessage()]
    assert len(warnings) == 1, warnings  # four bad messages, one line
    assert f"a message of {FRAMES + 1} frames" in warnings[0], warnings
    assert not [r for r in caplog.records if r.exc_info]
