"""The per-worker engine over real ZMQ sockets: bytes arrive intact, hostile bytes get a
logged refusal and the listener keeps serving, a shared secret keeps strangers out, a full
receive buffer refuses a PUT, and a dead peer is a bounded error."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import msgspec
import pytest
import torch
import zmq

from kvx.layouts import get_layout
from kvx.plugins.p2p import messages
from kvx.plugins.p2p.buffers import RecvBuffer, SendStore
from kvx.plugins.p2p.engine import P2pEngine, TransferError
from kvx.plugins.p2p.messages import Geometry, Get, TensorMeta
from kvx.plugins.p2p.planes import CpuPlane
from kvx.plugins.p2p.tensors import assemble, gather, physical
from kvx.wire import encode, seal

from ._ports import free_port_range

GEOMETRY = Geometry(1, 1, 2, 4, 4, "NHD", "float32", False, 1)
SECRET = "p2p test secret"


def _tensor(seed: int) -> tuple[TensorMeta, torch.Tensor]:
    layout = get_layout("NHD")
    t = layout.allocate(3, 4, 2, 4, dtype=torch.float32)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + seed)
    wire = physical(t, layout)
    meta = TensorMeta(f"req{seed}", "l0", 0, 0, 2, 4, 4, 3, 10, "NHD", "float32", wire.numel())
    return meta, t


def _engine(port: int | None, secret: str | None = None, **kw: object) -> P2pEngine:
    listen = ("127.0.0.1", port) if port is not None else None
    return P2pEngine(
        f"test-{port}",
        listen,
        CpuPlane(),
        GEOMETRY,
        secret=secret,
        timeout_s=2.0,
        max_tensor_bytes=1 << 20,
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
def receiver() -> Iterator[P2pEngine]:
    engine = _engine(free_port_range(1), recv=RecvBuffer(1 << 20, 0, 60))
    yield engine
    engine.close()


@pytest.mark.timeout(60)
def test_put_lands_byte_for_byte(receiver: P2pEngine) -> None:
    sender = _engine(None)
    try:
        meta, t = _tensor(1)
        assert sender.geometry_of(receiver.address or "") == GEOMETRY
        sender.put(receiver.address or "", meta, physical(t, get_layout("NHD")))
        assert receiver.recv is not None
        assert receiver.recv.wait_for([("req1", "l0", 0)], "req1", time.monotonic() + 5) is None
        got_meta, got = receiver.recv.take(("req1", "l0", 0), torch.device("cpu"))
        assert got_meta == meta and torch.equal(assemble(got, got_meta), t)
    finally:
        sender.close()


@pytest.mark.timeout(60)
def test_hostile_bytes_are_refused_and_the_listener_survives(receiver: P2pEngine) -> None:
    counts: dict[str, int] = {}
    assert receiver.listener is not None
    receiver.listener.count = lambda key, n: counts.__setitem__(key, counts.get(key, 0) + n)
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://{receiver.address}")
    meta, t = _tensor(2)
    big = TensorMeta("x", "l0", 0, 0, 2, 4, 4, 3, 10, "NHD", "float32", 1 << 30)
    lying = TensorMeta("x", "l0", 0, 0, 2, 4, 4, 3, 10, "NHD", "float32", meta.nbytes + 4)
    hostile = [
        [b"\x95\xa1\x8a\x00\x00\xc4\x00"],  # garbage msgpack
        [b""],
        [encode({"cmd": "PUT", "tensor_id": "a#b", "shape": [1], "dtype": "x"})],  # vLLM's dict
        [seal("wrong secret", messages.REQUEST_DOMAIN, b"\x00" * 40)],
        [messages.seal_request(None, messages.Put(meta))[0], b"x"],  # PUT before HELLO
        [messages.seal_request(None, messages.Hello("nccl", b"u" * 128))[0]],  # other plane
        [messages.seal_request(None, messages.Hello("cpu"))[0]],
        [messages.seal_request(None, messages.Put(big))[0], b"x"],  # over max_tensor_bytes
        [messages.seal_request(None, messages.Put(lying))[0], b"x" * lying.nbytes],
        [messages.seal_request(None, messages.Put(meta))[0], b"short"],  # frame != announced
        [messages.seal_request(None, messages.Put(meta))[0]],  # no data frame
    ]
    try:
        for frames in hostile:
            raw.send_multipart(frames)
            if raw.poll(300):
                raw.recv_multipart()
        # still serving: a proper sender gets its tensor through
        sender = _engine(None)
        try:
            sender.put(receiver.address or "", meta, physical(t, get_layout("NHD")))
        finally:
            sender.close()
    finally:
        raw.close(0)
        context.term()
    assert receiver.recv is not None
    assert receiver.recv.wait_for([("req2", "l0", 0)], "req2", time.monotonic() + 5) is None
    assert counts.get("refused_messages", 0) >= 8, counts


@pytest.mark.timeout(60)
def test_shared_secret_keeps_strangers_out() -> None:
    port = free_port_range(1)
    receiver = _engine(port, SECRET, recv=RecvBuffer(1 << 20, 0, 60))
    stranger, friend = _engine(None), _engine(None, SECRET)
    try:
        meta, t = _tensor(3)
        # never answered, never decoded; the error names the exchange that got no reply
        with pytest.raises(TransferError, match=r"HELLO before PUT of 1 tensors \(req3#l0"):
            stranger.put(receiver.address or "", meta, physical(t, get_layout("NHD")))
        friend.put(receiver.address or "", meta, physical(t, get_layout("NHD")))
        assert receiver.recv is not None
        assert receiver.recv.wait_for([("req3", "l0", 0)], "req3", time.monotonic() + 5) is None
    finally:
        for engine in (stranger, friend, receiver):
            engine.close()


@pytest.mark.timeout(60)
def test_full_receive_buffer_refuses_the_put() -> None:
    receiver = _engine(free_port_range(1), recv=RecvBuffer(64, 0, 60))
    sender = _engine(None)
    try:
        meta, t = _tensor(4)
        with pytest.raises(TransferError, match="receive buffer full"):
            sender.put(receiver.address or "", meta, physical(t, get_layout("NHD")))
        assert receiver.recv is not None and receiver.recv.used_bytes == 0
    finally:
        sender.close()
        receiver.close()


@pytest.mark.timeout(60)
def test_get_serves_a_head_slice_and_a_dead_peer_is_bounded() -> None:
    store = SendStore(1 << 20, 60)
    server = _engine(free_port_range(1), store=store)
    client = _engine(None)
    try:
        meta, t = _tensor(5)
        store.put(meta, t)
        got_meta, got, _ = client.get(
            server.address or "", Get("req5", "l0", 1, 1, 1), time.monotonic() + 5
        )
        expected = gather(t, get_layout("NHD"), [0, 1, 2], range(1, 2), 4)
        assert (got_meta.first_head, got_meta.num_heads) == (1, 1)
        assert torch.equal(assemble(got, got_meta), expected)
        assert len(store) == 0  # its one reader read it
        with pytest.raises(TransferError, match="not held here"):
            client.get(server.address or "", Get("req5", "l0", 0, 2, 1), time.monotonic() + 5)
        address = server.address or ""
        server.close()
        start = time.monotonic()
        stuck = re.escape(f"GET req5#l0 heads 0..2: no reply from {address}")
        with pytest.raises(TransferError, match=stuck):
            client.get(address, Get("req5", "l0", 0, 2, 1), time.monotonic() + 1)
        assert time.monotonic() - start < 5
        # a peer that is not running at all fails at first contact, not after the timeout
        start = time.monotonic()
        with pytest.raises(TransferError, match=r"GET req5#l0 heads 0\.\.2: cannot connect"):
            client.get(address, Get("req5", "l0", 0, 2, 1), time.monotonic() + 20)
        assert time.monotonic() - start < 5
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_geometry_of_a_paired_peer_does_not_wait_for_a_send_in_flight(
    receiver: P2pEngine,
) -> None:
    """P's next layer asks D's geometry while PUT_ASYNC's sender holds the peer, waiting for
    acks; a known geometry must not queue behind that (it serialized copy-out and sending)."""
    import threading

    sender = _engine(None)
    try:
        address = receiver.address or ""
        assert sender.geometry_of(address) == GEOMETRY  # paired
        peer = sender._connections.known(address)
        assert peer is not None
        answered = threading.Event()
        with peer.lock:  # a send in flight
            thread = threading.Thread(
                target=lambda: sender.geometry_of(address) == GEOMETRY and answered.set()
            )
            thread.start()
            got = answered.wait(1.5)
        thread.join(5)
        assert got, "geometry_of waited for the peer's lock"
    finally:
        sender.close()


@pytest.mark.timeout(60)
def test_unacked_puts_settle_with_refusals_and_a_dead_peer() -> None:
    """PUT_ASYNC on the CPU plane: `send_puts` returns without waiting; `settle` reads the acks,
    reports a refused PUT and, within the timeout, those a dead peer never acked."""
    meta, t = _tensor(6)
    receiver = _engine(free_port_range(1), recv=RecvBuffer(meta.nbytes, 0, 60))  # room for one
    sender = _engine(None)
    try:
        address = receiver.address or ""
        other, u = _tensor(7)
        wire = [(meta, [physical(t, get_layout("NHD"))]), (other, [physical(u, get_layout("NHD"))])]
        assert sender.send_puts(address, wire) == []
        lost = sender.settle()
        assert [m.request_id for m, _ in lost] == ["req7"] and "receive buffer full" in lost[0][1]
        assert receiver.recv is not None
        got_meta, got = receiver.recv.take(("req6", "l0", 0), torch.device("cpu"))
        assert torch.equal(assemble(got, got_meta), t)
        assert sender.settle() == []  # nothing left to read
        receiver.close()
        assert sender.send_puts(address, wire[:1]) == []  # ZMQ queues it: no error yet
        start = time.monotonic()
        lost = sender.settle()
        assert [m.request_id for m, _ in lost] == ["req6"] and "no reply" in lost[0][1]
        assert time.monotonic() - start < 5
    finally:
        sender.close()
        receiver.close()


@pytest.mark.timeout(60)
def test_a_batch_of_slices_gets_one_ack_and_wrong_frames_are_refused_by_slice() -> None:
    """CPU plane: N slices to one peer travel as one sealed PUT_BATCH with one reply (the
    listener's per-PUT cost is paid once per batch); a slice whose frames do not match the
    header is refused naming it while the others land; a batch header announcing more slices or
    frames than allowed, or frames that do not add up, is refused and the listener goes on."""
    counts: dict[str, int] = {}
    receiver = _engine(free_port_range(1), recv=RecvBuffer(1 << 20, 0, 60))
    assert receiver.listener is not None
    receiver.listener.count = lambda key, n: counts.__setitem__(key, counts.get(key, 0) + n)
    sender = _engine(None)
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        address = receiver.address or ""
        layout = get_layout("NHD")
        slices = [_tensor(seed) for seed in range(10, 18)]
        replies = []
        original = sender._connections.reply
        sender._connections.reply = lambda *a: replies.append(a) or original(*a)  # type: ignore[method-assign]
        wire = [(meta, [physical(t, layout)[:64], physical(t, layout)[64:]]) for meta, t in slices]
        assert sender.send_puts(address, wire) == [] and sender.settle() == []
        assert len(replies) == 2, "8 slices: one HELLO reply and one batch ack"
        assert receiver.recv is not None
        for meta, t in slices:
            got_meta, got = receiver.recv.take((meta.request_id, "l0", 0), torch.device("cpu"))
            assert got_meta == meta and torch.equal(assemble(got, got_meta), t)

        # a hostile sender: wrong-size frame for slice 1 of 3, the others land
        raw.connect(f"tcp://{address}")
        raw.send_multipart([messages.seal_request(None, messages.Hello("cpu"))[0]])
        assert raw.poll(5000)
        raw.recv_multipart()
        (m0, t0), (m1, t1), (m2, t2) = _tensor(20), _tensor(21), _tensor(22)
        bad = bytes(physical(t1, layout)[:-4].numpy())
        header, nonce = messages.seal_request(None, messages.PutBatch([m0, m1, m2], [1, 1, 1]))
        frames = [bytes(physical(t, layout).numpy()) for t in (t0, t1, t2)]
        raw.send_multipart([header, frames[0], bad, frames[2]])
        assert raw.poll(5000)
        reply = messages.open_reply(None, nonce, raw.recv_multipart()[0])
        assert reply.ok and [r.index for r in reply.refused] == [1]
        assert "slice 1 (req21#l0)" in reply.refused[0].why and "announced" in reply.refused[0].why
        for key in (("req20", "l0", 0), ("req22", "l0", 0)):
            assert receiver.recv.take(key, torch.device("cpu"))[0].request_id == key[0]
        assert len(receiver.recv) == 0, "the wrong-size slice was kept"

        # hostile headers: over the bounds, or frames that do not add up
        envelope = msgspec.to_builtins(
            messages.Envelope(b"n" * 16, time.time(), messages.PutBatch([m0], [1])),
            builtin_types=(bytes,),
        )
        hostile = []
        for metas, numbers in (([m0] * 257, [1] * 257), ([m0], [257]), ([m0, m0], [1])):
            batch = {"type": "put_batch", "metas": msgspec.to_builtins(metas), "frames": numbers}
            hostile.append(encode({**envelope, "message": batch}))
        for frame in hostile:
            raw.send_multipart([frame, frames[0]])
            assert not raw.poll(300), "an undecodable batch header got an answer"
        refused = counts.get("refused_messages", 0)
        assert refused >= 4, counts  # slice 1 above and the three headers
        header, nonce = messages.seal_request(None, messages.PutBatch([m0, m2], [1, 1]))
        raw.send_multipart([header, frames[0]])  # two slices announced, one frame sent
        assert raw.poll(5000)
        reply = messages.open_reply(None, nonce, raw.recv_multipart()[0])
        assert not reply.ok and "1 data frames, the batch header announces 2" in reply.error
        assert len(receiver.recv) == 0

        # still serving
        meta, t = _tensor(30)
        sender.put(address, meta, physical(t, layout))
        assert receiver.recv.take(("req30", "l0", 0), torch.device("cpu"))[0] == meta
    finally:
        raw.close(0)
        context.term()
        sender.close()
        receiver.close()


def test_batches_stay_within_the_slice_count_and_header_size_bounds() -> None:
    """300 slices with 500-character request ids: no batch over MAX_BATCH slices or a sealed
    header over MAX_CONTROL_BYTES (D would refuse it), every slice once, in order."""
    engine = _engine(None, secret=SECRET)
    try:
        layout = get_layout("NHD")
        meta, t = _tensor(40)
        items = [
            (
                msgspec.structs.replace(meta, request_id=f"{i:03d}" + "r" * 497),
                [physical(t, layout)],
            )
            for i in range(300)
        ]
        batches = engine._seal_batches(items)
        assert len(batches) > 2
        assert all(len(m) <= messages.MAX_BATCH for _, _, m, _ in batches)
        assert all(len(e) <= messages.MAX_CONTROL_BYTES for e, _, _, _ in batches)
        sent = [m.request_id for _, _, metas, _ in batches for m in metas]
        assert sent == [m.request_id for m, _ in items]
        envelope = messages.open_request(SECRET, batches[0][0])
        assert isinstance(envelope.message, messages.PutBatch)
    finally:
        engine.close()
