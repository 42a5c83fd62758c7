"""The NCCL data plane between two CUDA devices: the same engine code as the CPU plane (HELLO
carries the unique id, then PUT/GET), bytes moved by ncclSend/ncclRecv and checked."""

from __future__ import annotations

import time

import pytest
import torch

from kvx.layouts import get_layout
from kvx.plugins.p2p.buffers import RecvBuffer, SendStore
from kvx.plugins.p2p.engine import P2pEngine
from kvx.plugins.p2p.messages import Geometry, Get, TensorMeta
from kvx.plugins.p2p.planes import choose_plane
from kvx.plugins.p2p.tensors import assemble, physical

from ._ports import free_port_range

GEOMETRY = Geometry(1, 1, 2, 8, 16, "HND", "float16", False, 1)
pytestmark = [pytest.mark.needs_cuda, pytest.mark.timeout(120)]


def _engine(device: str, port: int | None, **kw: object) -> P2pEngine:
    plane = choose_plane("auto", torch.device(device), 8)
    assert plane.name == "nccl"  # chosen automatically for CUDA tensors
    listen = ("127.0.0.1", port) if port is not None else None
    return P2pEngine(
        f"nccl-{device}",
        listen,
        plane,
        GEOMETRY,
        secret=None,
        timeout_s=30,
        max_tensor_bytes=1 << 30,
        **kw,  # type: ignore[arg-type]
    )


def _slice(device: str) -> tuple[TensorMeta, torch.Tensor]:
    layout = get_layout("HND")
    t = layout.allocate(4, 16, 2, 8, dtype=torch.float16, device=device)
    t.copy_(torch.randn(t.shape, dtype=torch.float16, device=device))
    nbytes = t.numel() * t.element_size()
    return TensorMeta("r", "l0", 0, 0, 2, 8, 16, 4, 60, "HND", "float16", nbytes), t


def test_put_over_nccl() -> None:
    receiver = _engine("cuda:1", free_port_range(1), recv=RecvBuffer(1 << 30, 0, 60))
    sender = _engine("cuda:0", None)
    try:
        meta, t = _slice("cuda:0")
        sender.put(receiver.address or "", meta, physical(t, get_layout("HND")))
        assert receiver.recv is not None
        assert receiver.recv.wait_for([("r", "l0", 0)], "r", time.monotonic() + 30) is None
        got_meta, got = receiver.recv.take(("r", "l0", 0), torch.device("cuda:1"))
        assert torch.equal(assemble(got, got_meta).cpu(), t.cpu())
    finally:
        sender.close()
        receiver.close()


def test_get_over_nccl() -> None:
    store = SendStore(1 << 30, 60)
    server = _engine("cuda:0", free_port_range(1), store=store)
    client = _engine("cuda:1", None)
    try:
        meta, t = _slice("cuda:0")
        store.put(meta, t)
        got_meta, got, _ = client.get(
            server.address or "", Get("r", "l0", 0, 2, 1), time.monotonic() + 30
        )
        assert torch.equal(assemble(got, got_meta).cpu(), t.cpu())
    finally:
        client.close()
        server.close()


def test_a_peer_that_never_joins_does_not_stop_the_listener() -> None:
    """A HELLO whose sender never calls ncclCommInitRank (it vanished after the reply) leaves
    one stuck init thread on the receiver, not a dead listener: the next sender gets through."""
    import zmq

    from kvx.plugins.p2p import messages

    receiver = _engine("cuda:1", free_port_range(1), recv=RecvBuffer(1 << 30, 0, 60))
    sender = _engine("cuda:0", None)
    context = zmq.Context()
    ghost = context.socket(zmq.DEALER)
    ghost.setsockopt(zmq.LINGER, 0)
    try:
        ghost.connect(f"tcp://{receiver.address}")
        uid = sender.plane.new_pair_id()
        ghost.send(messages.seal_request(None, messages.Hello("nccl", uid))[0])
        assert ghost.poll(10_000), "the listener did not answer the HELLO"
        ghost.close(0)
        meta, t = _slice("cuda:0")
        start = time.monotonic()
        sender.put(receiver.address or "", meta, physical(t, get_layout("HND")))
        assert time.monotonic() - start < 30
        assert receiver.recv is not None
        assert receiver.recv.wait_for([("r", "l0", 0)], "r", time.monotonic() + 30) is None
        got_meta, got = receiver.recv.take(("r", "l0", 0), torch.device("cuda:1"))
        assert torch.equal(assemble(got, got_meta).cpu(), t.cpu())
    finally:
        context.term()
        sender.close()
        receiver.close()


def test_two_workers_sending_to_each_other_at_once() -> None:
    """Sends and receives run on separate streams: each worker receives from the other while it
    sends to it (one shared stream would queue each send behind a receive: a deadlock)."""
    import threading

    a = _engine("cuda:0", free_port_range(1), recv=RecvBuffer(1 << 30, 0, 60))
    b = _engine("cuda:1", free_port_range(1), recv=RecvBuffer(1 << 30, 0, 60))
    try:
        (meta, ta), (_, tb) = _slice("cuda:0"), _slice("cuda:1")
        errors: list[BaseException] = []

        def push(src: P2pEngine, dst: P2pEngine, t: torch.Tensor) -> None:
            try:
                for _ in range(20):
                    src.put(dst.address or "", meta, physical(t, get_layout("HND")))
            except BaseException as exc:
                errors.append(exc)

        threads = [
            threading.Thread(target=push, args=(a, b, ta)),
            threading.Thread(target=push, args=(b, a, tb)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        assert not errors and not any(thread.is_alive() for thread in threads)
        for engine, t, device in ((b, ta, "cuda:1"), (a, tb, "cuda:0")):
            assert engine.recv is not None
            got_meta, got = engine.recv.take(("r", "l0", 0), torch.device(device))
            assert torch.equal(assemble(got, got_meta).cpu(), t.cpu())
    finally:
        a.close()
        b.close()
