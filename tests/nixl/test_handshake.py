"""The side channel and the two-phase handshake over real ZMQ sockets: refusals name what is
wrong, and a bad peer (garbage, oversized or unsigned replies, silence) never hangs D."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace

import pytest
import zmq

from kvx import EngineContext, KVCacheSpec
from kvx.plugins.nixl.handshake import (
    AgentMetadata,
    HandshakeError,
    HandshakePayload,
    Region,
    compatibility_factors,
    compatibility_hash,
)
from kvx.plugins.nixl.metadata import RemoteRead
from kvx.plugins.nixl.remote import LocalView, fetch_remote
from kvx.plugins.nixl.side_channel import SideChannelServer, fetch_payload
from kvx.topology import KVGeometry
from kvx.wire import curve_server, encode

LAYERS = ("layer.0", "layer.1")


def context(**cache: object) -> EngineContext:
    spec = KVCacheSpec(layer_names=LAYERS, num_kv_heads=4, head_size=16, block_size=16)
    return EngineContext("P", "kvx-toy", replace(spec, **cache))  # type: ignore[arg-type]


def local_view(ctx: EngineContext) -> LocalView:
    return LocalView(
        "D",
        0,
        1,
        1,
        KVGeometry(1, 4, 16, "HND"),
        LAYERS,
        compatibility_factors(ctx),
        ctx.cache.dtype,
        ctx.cache.head_size,
    )


def agent_meta(engine_id: str = "P") -> bytes:
    regions = [
        Region(name, kv, 4096 * (i + 1), 4096, 8) for i, name in enumerate(LAYERS) for kv in (0, 1)
    ]
    return encode(
        AgentMetadata(engine_id, b"agent", 0, 0, 1, 1, 4, 16, 16, "HND", "float32", False, regions)
    )


def read_spec(port: int, engine_id: str = "P") -> RemoteRead:
    return RemoteRead("r", [1], engine_id, "r", [3], 10, "127.0.0.1", port, 1, 1)


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    ctx = context()
    factors = compatibility_factors(ctx)
    srv = SideChannelServer(
        "127.0.0.1", 0, compatibility_hash(factors), factors, {(0, 0): agent_meta()}, secret=None
    )
    try:
        yield srv
    finally:
        srv.close()


def fetch(view: LocalView, port: int, engine_id: str = "P", **kw: object):
    options = {"timeout_s": 2.0, "max_bytes": 1 << 16, "secret": None, "enforce_compat": True}
    return fetch_remote(view, read_spec(port, engine_id), **{**options, **kw})  # type: ignore


@pytest.mark.timeout(30)
def test_matching_peer_is_accepted(server: SideChannelServer) -> None:
    metas = fetch(local_view(context()), server.port)
    assert list(metas) == [(0, 0)] and metas[(0, 0)].engine_id == "P"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("cache", "needle"),
    [
        ({"dtype": "bfloat16"}, "dtype (local 'bfloat16', remote 'float32')"),
        ({"head_size": 32}, "head_size (local '32', remote '16')"),
        ({"num_kv_heads": 8}, "num_kv_heads (local '8', remote '4')"),
    ],
)
def test_compat_hash_mismatch_names_the_factor(
    server: SideChannelServer, cache: dict[str, object], needle: str
) -> None:
    with pytest.raises(HandshakeError, match="compatibility hash mismatch") as err:
        fetch(local_view(context(**cache)), server.port)
    assert needle in str(err.value)


@pytest.mark.timeout(30)
def test_block_size_and_tp_are_not_hashed() -> None:
    assert compatibility_factors(context()) == compatibility_factors(context(block_size=32))


@pytest.mark.timeout(30)
def test_engine_id_mismatch_is_refused(server: SideChannelServer) -> None:
    with pytest.raises(HandshakeError, match=r"engine id mismatch.*'Q'.*serves engine 'P'"):
        fetch(local_view(context()), server.port, engine_id="Q")


class GarbageServer:
    """A real ZMQ ROUTER that answers every request with `reply` (faults a correct P cannot
    produce, so they are served by hand)."""

    def __init__(self, reply: bytes, secret: str | None = None) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.auth = curve_server(self.socket, secret) if secret is not None else None
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.reply = reply
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stop.is_set():
            if self.socket.poll(50):
                identity, empty, _ = self.socket.recv_multipart()
                self.socket.send_multipart([identity, empty, self.reply])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.socket.close()
        if self.auth is not None:
            self.auth.stop()
        self.context.term()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("reply", "needle"),
    [
        (b"K\xc1 not msgpack", "malformed HandshakePayload"),
        (b"K" + encode({"compatibility_hash": 7}), "malformed HandshakePayload"),
        (b"\xc1 no tag", "malformed reply"),
        (b"\x00" * ((1 << 16) + 1), "exceeds the limit of 65536 bytes"),
        (b"Ego away\x00\xff", "peer refused: go away?"),
    ],
)
def test_bad_replies_are_refused(reply: bytes, needle: str) -> None:
    garbage = GarbageServer(reply)
    try:
        with pytest.raises(HandshakeError, match="side channel") as err:
            fetch_payload(
                "127.0.0.1", garbage.port, 0, 0, timeout_s=2, max_bytes=1 << 16, secret=None
            )
        assert needle in str(err.value)
    finally:
        garbage.close()


@pytest.mark.timeout(30)
def test_malformed_agent_metadata_is_refused() -> None:
    factors = compatibility_factors(context())
    srv = SideChannelServer(
        "127.0.0.1", 0, compatibility_hash(factors), factors, {(0, 0): b"\x93garbage"}, secret=None
    )
    try:
        with pytest.raises(HandshakeError, match="agent metadata: malformed AgentMetadata"):
            fetch(local_view(context()), srv.port)
    finally:
        srv.close()


@pytest.mark.timeout(30)
def test_silent_peer_times_out() -> None:
    context_ = zmq.Context()
    silent = context_.socket(zmq.ROUTER)  # accepts the connection, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(HandshakeError, match=r"no reply within 0\.5s"):
            fetch_payload("127.0.0.1", port, 0, 0, timeout_s=0.5, max_bytes=4096, secret=None)
    finally:
        silent.close(linger=0)
        context_.term()


@pytest.mark.timeout(30)
def test_shared_secret_authenticates_both_ways() -> None:
    factors = compatibility_factors(context())
    srv = SideChannelServer(
        "127.0.0.1",
        0,
        compatibility_hash(factors),
        factors,
        {(0, 0): agent_meta()},
        secret="correct horse",
    )
    try:
        assert fetch(local_view(context()), srv.port, secret="correct horse")
        # a CURVE server (keys from the secret): another secret, or none, fails the ZMQ
        # handshake, so nothing reaches the server and D's error says what to check
        for wrong in ("wrong secret", None):
            with pytest.raises(HandshakeError, match=r"no reply within .*same shared_secret"):
                fetch(local_view(context()), srv.port, secret=wrong)
        assert srv.refused == 0 and srv.served == 1
    finally:
        srv.close()
    # a server holding the secret (past the CURVE handshake) whose reply is not sealed
    unsigned = GarbageServer(b"K" + encode(HandshakePayload("h", {}, b"x")), "correct horse")
    try:
        with pytest.raises(HandshakeError, match="not signed with the shared secret"):
            fetch_payload(
                "127.0.0.1",
                unsigned.port,
                0,
                0,
                timeout_s=2,
                max_bytes=4096,
                secret="correct horse",
            )
    finally:
        unsigned.close()


@pytest.mark.timeout(30)
def test_server_binds_loopback_and_stops_cleanly() -> None:
    before = {t.name for t in threading.enumerate()}
    factors = compatibility_factors(context())
    srv = SideChannelServer("127.0.0.1", 0, "h", factors, {}, secret=None)
    assert srv.host == "127.0.0.1"
    srv.close()
    assert {t.name for t in threading.enumerate()} == before
