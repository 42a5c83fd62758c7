"""A D that dies while P is connected to it (SIGKILL, a real process) fails P's exchanges with it
at once, not after the whole `transfer_timeout_s`; a D that is only slow (SIGSTOP: its kernel
still accepts connections) still gets the whole timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from kvx.layouts import get_layout
from kvx.plugins.p2p.engine import P2pEngine
from kvx.plugins.p2p.messages import Geometry, TensorMeta
from kvx.plugins.p2p.planes import CpuPlane
from kvx.plugins.p2p.tensors import physical

from ._ports import free_port_range

GEOMETRY = Geometry(1, 1, 2, 4, 4, "NHD", "float32", False, 1)
DECODE = """
import sys, time
from kvx.plugins.p2p.buffers import RecvBuffer
from kvx.plugins.p2p.engine import P2pEngine
from kvx.plugins.p2p.messages import Geometry
from kvx.plugins.p2p.planes import CpuPlane
geometry = Geometry(1, 1, 2, 4, 4, "NHD", "float32", False, 1)
engine = P2pEngine("dead-peer-d", ("127.0.0.1", int(sys.argv[1])), CpuPlane(), geometry,
                   secret=None, timeout_s=5, max_tensor_bytes=1 << 20,
                   recv=RecvBuffer(1 << 20, 0, 60))
print("listening", flush=True)
time.sleep(120)
"""


def _put(seed: int) -> list[tuple[TensorMeta, list[torch.Tensor]]]:
    layout = get_layout("NHD")
    t = layout.allocate(3, 4, 2, 4, dtype=torch.float32)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + seed)
    wire = physical(t, layout)
    meta = TensorMeta(f"req{seed}", "l0", 0, 0, 2, 4, 4, 3, 10, "NHD", "float32", wire.numel())
    return [(meta, [wire])]


@pytest.fixture
def decode() -> Iterator[tuple[subprocess.Popen[str], str]]:
    port = free_port_range(1)
    child = subprocess.Popen(
        [sys.executable, "-c", DECODE, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "listening"
        yield child, f"127.0.0.1:{port}"
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
        child.wait(timeout=10)


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within 10s of SIGSTOP")


@contextmanager
def _prefill(address: str, timeout_s: float) -> Iterator[P2pEngine]:
    """P, paired with the D at `address` (the connection stays open), closed afterwards."""
    prefill = P2pEngine(
        "dead-peer-p",
        None,
        CpuPlane(),
        GEOMETRY,
        secret=None,
        timeout_s=timeout_s,
        max_tensor_bytes=1 << 20,
    )
    try:
        assert prefill.geometry_of(address) == GEOMETRY
        yield prefill
    finally:
        prefill.close()


@pytest.mark.timeout(60)
def test_a_killed_decode_fails_at_once_a_stopped_one_gets_the_whole_timeout(
    decode: tuple[subprocess.Popen[str], str],
) -> None:
    child, address = decode
    with _prefill(address, timeout_s=3) as prefill:
        os.kill(child.pid, signal.SIGSTOP)  # alive but not answering: its kernel still accepts
        _wait_stopped(child.pid)
        start = time.monotonic()
        failed = prefill.put_many(address, _put(4))
        elapsed = time.monotonic() - start
        os.kill(child.pid, signal.SIGCONT)
        assert [m.request_id for m, _ in failed] == ["req4"]
        assert "within" in failed[0][1] and "refuses" not in failed[0][1]
        assert elapsed >= 2.5, f"a stopped D failed after {elapsed:.1f}s of the 3s timeout"
    with _prefill(address, timeout_s=20) as prefill:
        assert prefill.send_puts(address, _put(1)) == [] and prefill.settle() == []
        child.kill()  # SIGKILL
        child.wait(timeout=10)
        start = time.monotonic()
        assert prefill.send_puts(address, _put(2)) == []  # ZMQ queues it: no error yet
        lost = prefill.settle()
        elapsed = time.monotonic() - start
        assert [m.request_id for m, _ in lost] == ["req2"]
        assert f"no reply from {address}" in lost[0][1] and "refuses" in lost[0][1]
        assert elapsed < 5, f"a dead D cost {elapsed:.1f}s of the 20s timeout"
        # the synchronous PUT too
        start = time.monotonic()
        failed = prefill.put_many(address, _put(3))
        assert [m.request_id for m, _ in failed] == ["req3"] and "connect" in failed[0][1]
        assert time.monotonic() - start < 5
