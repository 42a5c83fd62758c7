"""Peers an attacker runs against the P2P listener (with a shared secret set): a message of a
million tiny frames is refused without holding them all in Python and a legitimate PUT is
still served after it; the receive buffer bounds its entries (zero-byte PUTs) with O(1)
admission; a GET for zero heads gets a refusal, not an unexpected error.

KVX_P2P_FRAMES (default 1,000,000) sets the frame count; the issue's reproducer is 4,000,000.
libzmq itself queues a whole multipart message (~64 bytes a frame) before any frame of it can
be read, so that much memory is beyond the listener's reach."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from kvx.layouts import get_layout
from kvx.plugins.p2p.buffers import RecvBuffer
from kvx.plugins.p2p.engine import P2pEngine
from kvx.plugins.p2p.messages import Geometry, Get, TensorMeta
from kvx.plugins.p2p.planes import CpuPlane
from kvx.plugins.p2p.tensors import physical

from ._ports import free_port_range

pytestmark = pytest.mark.timeout(240)

GEOMETRY = Geometry(1, 1, 2, 4, 4, "NHD", "float32", False, 1)
SECRET = "hostile-peer-secret"
FRAMES = int(os.environ.get("KVX_P2P_FRAMES", "1000000"))
LIBZMQ_BYTES_PER_FRAME = 64
ATTACKER = """
import sys, time, zmq
socket = zmq.Context().socket(zmq.DEALER)
socket.connect("tcp://" + sys.argv[1])
socket.send_multipart([b""] * int(sys.argv[2]))
print("sent", flush=True)
time.sleep(120)
"""


def _put(seed: int) -> tuple[TensorMeta, torch.Tensor]:
    layout = get_layout("NHD")
    t = layout.allocate(3, 4, 2, 4, dtype=torch.float32)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + seed)
    wire = physical(t, layout)
    meta = TensorMeta(f"req{seed}", "l0", 0, 0, 2, 4, 4, 3, 10, "NHD", "float32", wire.numel())
    return meta, wire


def peak_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def reset_peak() -> None:
    """Start VmHWM afresh: an earlier test in this process may have peaked higher."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_message_of_a_million_frames_is_refused_and_a_put_still_served(caplog) -> None:
    caplog.set_level(logging.WARNING)
    port = free_port_range(1)
    address = f"127.0.0.1:{port}"
    recv = RecvBuffer(1 << 20, 0, 60)
    decode = P2pEngine(
        "hostile-d",
        ("127.0.0.1", port),
        CpuPlane(),
        GEOMETRY,
        secret=SECRET,
        timeout_s=20,
        max_tensor_bytes=1 << 20,
        recv=recv,
    )
    prefill = P2pEngine(
        "hostile-p",
        None,
        CpuPlane(),
        GEOMETRY,
        secret=SECRET,
        timeout_s=60,
        max_tensor_bytes=1 << 20,
    )
    attacker = None
    try:
        assert prefill.geometry_of(address) == GEOMETRY
        before = rss_mib()
        attacker = subprocess.Popen(  # its own process: its send queue is not counted here
            [sys.executable, "-c", ATTACKER, address, str(FRAMES)], stdout=subprocess.PIPE
        )
        assert attacker.stdout is not None and attacker.stdout.readline() == b"sent\n"
        time.sleep(0.5)
        meta, wire = _put(1)
        start = time.monotonic()
        assert prefill.put_many(address, [(meta, [wire])]) == []
        served_after = time.monotonic() - start
        key = (meta.request_id, meta.layer, meta.first_head)
        assert recv.wait_for([key], meta.request_id, time.monotonic() + 10) is None
        _, [got] = recv.take(key, torch.device("cpu"))
        assert torch.equal(got.view(-1), wire.view(-1))  # every byte of the legit PUT
        deadline = time.monotonic() + 120
        while not [r for r in caplog.records if "refused a message" in r.getMessage()]:
            assert time.monotonic() < deadline, "the listener never refused the message"
            time.sleep(0.1)
        meta, wire = _put(3)  # and after it
        assert prefill.put_many(address, [(meta, [wire])]) == []
        key = (meta.request_id, meta.layer, meta.first_head)
        assert recv.wait_for([key], meta.request_id, time.monotonic() + 10) is None
        growth = peak_mib() - before
        libzmq = FRAMES * LIBZMQ_BYTES_PER_FRAME / (1 << 20)
        assert growth <= libzmq + 64, f"grew {growth:.0f} MiB; libzmq's queue is {libzmq:.0f}"
        assert served_after < 60, served_after
    finally:
        if attacker is not None:
            attacker.kill()
            attacker.wait(10)
        prefill.close()
        decode.close()
    refusals = [r.getMessage() for r in caplog.records if "refused a message" in r.getMessage()]
    assert refusals and f"{FRAMES + 1} frames, at most" in refusals[0]  # and the identity, refusals
    assert not [r for r in caplog.records if r.exc_info], "a traceback for a peer's message"


def _meta(request_id: str, nbytes: int) -> TensorMeta:
    return TensorMeta(request_id, "l0", 0, 0, 1, 4, 4, 1, 4, "NHD", "float32", nbytes)


def test_the_receive_buffer_bounds_entries_and_admits_in_constant_time() -> None:
    buffer = RecvBuffer(device_bytes=1 << 20, pool_bytes=0, ttl_s=600, max_entries=20_000)
    start = time.process_time()
    for i in range(20_000):
        assert buffer.admit(_meta(f"r{i}", 0)) is None
        buffer.put((f"r{i}", "l0", 0), _meta(f"r{i}", 0), [torch.zeros(0)], spill=False)
    elapsed = time.process_time() - start
    why = buffer.admit(_meta("one-more", 0))
    assert why == "receive buffer full: it holds 20000 slices (the most it takes)"
    assert len(buffer) == 20_000
    # each admission used to scan every entry (20,000 of them: ~200 million steps)
    assert elapsed < 20, f"20,000 admissions took {elapsed:.1f} s of CPU"
    assert buffer.discard("r0") == 1
    assert buffer.admit(_meta("again", 0)) is None  # room again


def test_expiry_drops_the_oldest_first() -> None:
    buffer = RecvBuffer(device_bytes=1 << 20, pool_bytes=0, ttl_s=0.2)
    for name in ("a", "b"):
        assert buffer.admit(_meta(name, 8)) is None
        buffer.put((name, "l0", 0), _meta(name, 8), [torch.zeros(2)], spill=False)
    time.sleep(0.3)
    assert buffer.admit(_meta("c", 8)) is None
    buffer.put(("c", "l0", 0), _meta("c", 8), [torch.zeros(2)], spill=False)
    assert len(buffer) == 1 and buffer.used_bytes == 8


def test_a_get_for_zero_heads_is_refused_cleanly(caplog) -> None:
    caplog.set_level(logging.WARNING)
    port = free_port_range(1)
    address = f"127.0.0.1:{port}"
    from kvx.plugins.p2p.buffers import SendStore

    store = SendStore(1 << 20, 60)
    meta, wire = _put(2)
    store.put(meta, wire)
    serving = P2pEngine(
        "hostile-p-store",
        ("127.0.0.1", port),
        CpuPlane(),
        GEOMETRY,
        secret=SECRET,
        timeout_s=10,
        max_tensor_bytes=1 << 20,
        store=store,
    )
    asking = P2pEngine(
        "hostile-d-get",
        None,
        CpuPlane(),
        GEOMETRY,
        secret=SECRET,
        timeout_s=10,
        max_tensor_bytes=1 << 20,
    )
    try:
        assert asking.geometry_of(address) == GEOMETRY
        with pytest.raises(Exception, match="num_heads 0; at least 1 is asked"):
            asking.get(address, Get("req2", "l0", 0, 0, 1), time.monotonic() + 10)
    finally:
        asking.close()
        serving.close()
    assert not [r for r in caplog.records if "ValueError" in r.getMessage()]
