"""Hostile peers on loopback against the real NIXL side channel, P's lease book-keeping and D's
checks of agent metadata: nothing crashes, nothing grows without bound, nothing a peer sends
frees blocks early, and a good handshake still works afterwards."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvx import EngineContext, KVCacheSpec, wire
from kvx.plugins.nixl.handshake import (
    MAX_REQUEST_BYTES,
    AgentMetadata,
    HandshakeError,
    Notification,
    Region,
    compatibility_factors,
    compatibility_hash,
)
from kvx.plugins.nixl.leases import MAX_EARLY, Leases
from kvx.plugins.nixl.metadata import RemoteRead
from kvx.plugins.nixl.remote import LocalView, fetch_remote
from kvx.plugins.nixl.side_channel import SideChannelServer, fetch_payload, make_request
from kvx.plugins.nixl.stats import NixlKVConnectorStats
from kvx.topology import KVGeometry

from .test_wire_fuzz import fuzz_inputs

LAYERS = ("layer.0", "layer.1")
SECRET = "hostile peers"
BLOCK_LEN = 4 * 16 * 4 * 16  # 4 heads of 16 float32 values, 16 tokens


def ctx() -> EngineContext:
    spec = KVCacheSpec(layer_names=LAYERS, num_kv_heads=4, head_size=16, block_size=16)
    return EngineContext("P", "kvx-toy", spec)


def view(num_blocks: int | None = 64) -> LocalView:
    c = ctx()
    return LocalView(
        "D",
        0,
        1,
        1,
        KVGeometry(1, 4, 16, "HND"),
        LAYERS,
        compatibility_factors(c),
        c.cache.dtype,
        c.cache.head_size,
        num_blocks=num_blocks,
    )


def meta(**changes: object) -> AgentMetadata:
    regions = [
        Region(name, kv, (i + 1) << 20, BLOCK_LEN, 64)
        for i, name in enumerate(LAYERS)
        for kv in (0, 1)
    ]
    good = AgentMetadata("P", b"agent", 0, 0, 1, 1, 4, 16, 16, "HND", "float32", False, regions)
    return msgspec.structs.replace(good, **changes)


def serve(payload: AgentMetadata, secret: str | None) -> SideChannelServer:
    factors = compatibility_factors(ctx())
    return SideChannelServer(
        "127.0.0.1",
        0,
        compatibility_hash(factors),
        factors,
        {(0, 0): wire.encode(payload)},
        secret=secret,
    )


def fetch(server: SideChannelServer, local: LocalView, secret: str | None = None) -> object:
    spec = RemoteRead("r", [1], "P", "r", [3], 10, "127.0.0.1", server.port, 1, 1)
    return fetch_remote(
        local, spec, timeout_s=5, max_bytes=1 << 20, secret=secret, enforce_compat=True
    )


@pytest.fixture(params=[None, SECRET], ids=["no-secret", "secret"])
def server(request: pytest.FixtureRequest) -> Iterator[SideChannelServer]:
    srv = serve(meta(), request.param)
    try:
        yield srv
    finally:
        srv.close()


@pytest.mark.timeout(60)
def test_side_channel_survives_garbage_and_still_answers(server: SideChannelServer) -> None:
    secret = server._secret
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    if secret is not None:  # a CURVE server: only a holder of the secret gets this far
        wire.curve_client(dealer, secret)
    dealer.connect(f"tcp://127.0.0.1:{server.port}")
    valid = [make_request(0, 0, secret)[0], wire.encode(["get_meta_msg", 0, 0])]
    # larger than MAX_REQUEST_BYTES: ZMQ drops the sender's connection (tried at the end)
    inputs = [data for data in fuzz_inputs(11, valid) if len(data) <= MAX_REQUEST_BYTES]
    answered = 0  # the valid requests (and, without a secret, mutations that stayed valid)
    try:
        for start in range(0, len(inputs), 200):  # pipelined: 200 requests, then their replies
            batch = inputs[start : start + 200]
            for data in batch:
                dealer.send_multipart([b"", data])
            for _ in batch:
                empty, reply = dealer.recv_multipart()
                assert empty == b"" and reply[:1] in (b"E", b"K"), reply[:80]
                answered += reply[:1] == b"K"
        dealer.send_multipart([b"odd", b"frames", b"here"])  # not a REQ envelope: dropped
        deadline = time.monotonic() + 10  # it went out before the socket closes
        while server.refused < len(inputs) - answered + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        dealer.send_multipart([b"", b"x" * 10_000])  # over MAXMSGSIZE: ZMQ drops the peer
    finally:
        dealer.close(linger=0)
        context.term()
    for junk in (b"\x00" * 64, b"GET / HTTP/1.0\r\n\r\n", random.Random(3).randbytes(4096)):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
            raw.sendall(junk)
    # refused: every input not answered, and the message that is not a REQ envelope (dropped
    # unanswered, and counted since listeners count what they drop). At least: in one CI run
    # of the whole suite 12 more were counted (the raw junk connections above, or a stray peer
    # of an earlier test on a reused port); `served` below stays exact.
    assert answered < len(inputs) // 10 and server.refused >= len(inputs) - answered + 1
    assert fetch(server, view(), secret)  # a good handshake is still answered
    assert server.served == answered + 1


@pytest.mark.timeout(60)
def test_a_signed_request_cannot_be_replayed() -> None:
    srv = serve(meta(), SECRET)
    context = zmq.Context()
    req = context.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.setsockopt(zmq.RCVTIMEO, 5000)
    wire.curve_client(req, SECRET)  # replayed by a holder of the secret (or of its keys)
    try:
        req.connect(f"tcp://127.0.0.1:{srv.port}")
        request, _ = make_request(0, 0, SECRET)
        req.send(request)
        assert req.recv()[:1] == b"K"
        req.send(request)  # the same bytes again
        assert req.recv() == b"Ereplayed request: this nonce was already used"
        stale = wire.seal(
            SECRET,
            b"kvx-nixl-handshake-request",
            wire.encode(["get_meta_msg", 0, 0, b"s" * 16, time.time() - 3600]),
        )
        req.send(stale)
        assert req.recv().startswith(b"Estale request: its timestamp is +3600s")
        fetch_payload("127.0.0.1", srv.port, 0, 0, timeout_s=5, max_bytes=1 << 20, secret=SECRET)
    finally:
        req.close(linger=0)
        context.term()
        srv.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"regions": [Region("layer.0", 0, 0, BLOCK_LEN, 3_000_000)]}, "claims 3000000 blocks"),
        ({"regions": [Region("layer.0", 0, 0, BLOCK_LEN * 2, 64)]}, "block_len 8192 bytes"),
        ({"regions": [Region("layer.0", -1, 0, BLOCK_LEN, 64)]}, "makes 8192"),
        ({"regions": [Region("layer.0", 0, 0, BLOCK_LEN, 8)] * 2}, "registered twice"),
        ({"regions": [Region(f"l{i}", 0, 0, BLOCK_LEN, 8) for i in range(5)]}, "5 regions"),
        ({"regions": [Region("layer.0", 0, 2**64 - 10, BLOCK_LEN, 8)]}, "address space"),
        ({"layout": "NOPE"}, "geometry is not usable"),
        ({"block_size": 32}, "makes 8192"),
    ],
)
def test_agent_metadata_is_checked_against_our_geometry(
    changes: dict[str, object], needle: str
) -> None:
    srv = serve(meta(**changes), None)
    try:
        started = time.monotonic()
        with pytest.raises(HandshakeError, match="engine P") as err:
            fetch(srv, view(num_blocks=64))
        assert needle in str(err.value)
        assert time.monotonic() - started < 5
    finally:
        srv.close()


@pytest.mark.timeout(60)
def test_block_limit_follows_our_capacity() -> None:
    """16x our capacity in tokens is accepted, one block more is not."""
    for blocks, ok in ((64 * 16, True), (64 * 16 + 1, False)):
        srv = serve(meta(regions=[Region("layer.0", 0, 0, BLOCK_LEN, blocks)]), None)
        try:
            if ok:
                assert fetch(srv, view(num_blocks=64))
            else:
                with pytest.raises(HandshakeError, match="at most 1024 accepted"):
                    fetch(srv, view(num_blocks=64))
        finally:
            srv.close()


def leases() -> Leases:
    return Leases(10.0, NixlKVConnectorStats())


def test_a_smaller_count_or_a_repeated_reader_does_not_free_early() -> None:
    lease = leases()
    lease.hold("r", 10.0, now=0.0)
    lease.on_notification(Notification("done", ["r"], 2), now=1.0, sender="d0")
    lease.on_notification(Notification("done", ["r"], 1), now=1.1, sender="d0")  # shrink?
    assert lease.take_finished() == set()
    lease.on_notification(Notification("done", ["r"], 3), now=1.2, sender="d1")  # grow
    assert lease.take_finished() == set()
    lease.on_notification(Notification("done", ["r"], 1), now=1.3, sender="d2")
    assert lease.take_finished() == {"r"}
    # counts of 0 or below never reach the leases: the message type refuses them
    for count in (0, -3):
        with pytest.raises(wire.WireError):
            wire.decode(wire.encode(Notification("done", ["x"], count)), Notification)


def test_early_notifications_for_the_same_reader_count_once() -> None:
    lease = leases()
    lease.on_notification(Notification("done", ["r"], 2), now=0.0, sender="d0")
    lease.on_notification(Notification("done", ["r"], 2), now=0.0, sender="d0")
    lease.hold("r", 10.0, now=0.1)
    assert lease.take_finished() == set()
    lease.on_notification(Notification("done", ["r"], 2), now=0.2, sender="d1")
    assert lease.take_finished() == {"r"}


@pytest.mark.timeout(60)
def test_unknown_request_ids_are_bounded() -> None:
    lease = leases()
    ids = [f"ghost-{i:07d}" for i in range(500_000)]
    for start in range(0, len(ids), 8192):
        lease.on_notification(Notification("done", ids[start : start + 8192]), now=0.0)
    assert len(lease._early) == MAX_EARLY
    assert lease.stats.data["num_unknown_notifications_dropped"] == len(ids) - MAX_EARLY
    lease.hold(ids[-1], 10.0, now=0.5)  # the newest are the ones kept
    assert lease.take_finished() == {ids[-1]}
    lease.expire(now=20.0)
    assert not lease._early
