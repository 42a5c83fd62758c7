"""Every wire message type, fed 10,000 random and mutated messages (seeded): `kvx.wire.decode`
and `decode_sealed` raise nothing but `WireError`, and a sealed message is refused before its
body is decoded."""

from __future__ import annotations

import random
import time
from typing import Any

import msgspec
import pytest

from kvx import wire
from kvx.engine.server import Command, Reply
from kvx.plugins.nixl.handshake import (
    NOTIFICATION_DOMAIN,
    AgentMetadata,
    HandshakePayload,
    HandshakeRequest,
    Notification,
    Region,
    open_notification,
    seal_notification,
)
from kvx.plugins.p2p import messages as p2p
from kvx.wire import WireError

MESSAGES = 10_000
SECRET = "fuzz secret"


def valid_messages() -> dict[str, tuple[Any, list[bytes]]]:
    """Per message type: the type and a few valid encodings to mutate."""
    region = Region("layer.0", 0, 4096, 4096, 8)
    meta = AgentMetadata(
        "P", b"agent", 0, 0, 1, 1, 4, 16, 16, "HND", "float32", False, [region, region]
    )
    return {
        "HandshakeRequest": (
            HandshakeRequest,
            [wire.encode(HandshakeRequest("get_meta_msg", 0, 1, b"n" * 16, time.time()))],
        ),
        "HandshakePayload": (
            HandshakePayload,
            [wire.encode(HandshakePayload("ab" * 32, {"model": "m"}, wire.encode(meta)))],
        ),
        "AgentMetadata": (AgentMetadata, [wire.encode(meta)]),
        "Region": (Region, [wire.encode(region)]),
        "Notification": (
            Notification,
            [
                wire.encode(Notification("done", ["req-1", "req-2"], 2)),
                wire.encode(Notification("heartbeat", ["r"] * 5)),
            ],
        ),
        "Command": (Command, [wire.encode(c) for c in _commands()]),
        "Reply": (Reply, [wire.encode(Reply(outputs=[], stats={"a": 1}))]),
        **_p2p_messages(),
    }


def _p2p_messages() -> dict[str, tuple[Any, list[bytes]]]:
    """P2pNcclConnector's control messages (its envelope carries HELLO, PUT, PUT_BATCH, GET)."""
    meta = p2p.TensorMeta("req", "layer.0", 0, 0, 2, 16, 16, 3, 40, "HND", "float32", 12288)
    geometry = p2p.Geometry(2, 1, 4, 16, 16, "HND", "float32", False, 2)
    envelopes = [
        p2p.Envelope(b"n" * 16, time.time(), message)
        for message in (
            p2p.Hello("cpu"),
            p2p.Hello("nccl", b"u" * 128),
            p2p.Put(meta),
            p2p.PutBatch([meta, meta], [1, 2]),
            p2p.Get("req", "layer.0", 0, 2, 1),
        )
    ]
    replies = [
        p2p.Reply(True, geometry=geometry),
        p2p.Reply(True, meta=meta),
        p2p.Reply(False, "no"),
        p2p.Reply(True, refused=[p2p.Refusal(1, "slice 1 (req#layer.0): too big")]),
    ]
    return {
        "P2pEnvelope": (p2p.Envelope, [wire.encode(e) for e in envelopes]),
        "P2pReply": (p2p.Reply, [wire.encode(r) for r in replies]),
        "P2pTensorMeta": (p2p.TensorMeta, [wire.encode(meta)]),
    }


def _commands() -> list[Any]:
    from kvx.engine.server import Abort, AddRequest, Step

    return [AddRequest("r", [1, 2, 3], 4, {"remote_port": 1}), Abort("r"), Step()]


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack-able value: what a peer that speaks msgpack but not our types sends."""
    kind = rng.randrange(10 if depth < 3 else 7)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, 1, -1, -3, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 3_000_000])
    if kind == 2:
        return rng.choice([0.0, -1.5, float("inf"), float("nan"), 1e308])
    if kind == 3:
        return "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randrange(8)))
    if kind == 4:
        return rng.randbytes(rng.randrange(20))
    if kind == 5:
        return rng.choice(["done", "heartbeat", "get_meta_msg", "DRAM", "HND", "float32"])
    if kind == 6:
        return "x" * rng.choice([0, 1, 2000, 70_000])
    if kind == 7:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(7))]
    if kind == 8:
        return {str(random_value(rng, 3)): random_value(rng, depth + 1) for _ in range(3)}
    return tuple(random_value(rng, depth + 1) for _ in range(rng.randrange(6)))


def mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randrange(1, 5)):
        op = rng.randrange(5)
        at = rng.randrange(len(out) + 1)
        if op == 0 and out:
            out[min(at, len(out) - 1)] = rng.randrange(256)
        elif op == 1:
            out[at:at] = rng.randbytes(rng.randrange(1, 9))
        elif op == 2:
            del out[at : at + rng.randrange(1, 9)]
        elif op == 3:
            out = out[:at]
        else:  # a msgpack header claiming a huge or odd length
            out[at:at] = rng.choice([b"\xdd\xff\xff\xff\xff", b"\xc6\x7f\xff\xff\xff", b"\xc1"])
    return bytes(out)


def fuzz_inputs(seed: int, valid: list[bytes]) -> list[bytes]:
    rng = random.Random(seed)
    inputs = [b"\x95\xa1\x8a\x00\x00\xc4\x00"]  # the 7 bytes that killed the side channel
    while len(inputs) < MESSAGES:
        pick = rng.randrange(3)
        if pick == 0:
            inputs.append(rng.randbytes(rng.randrange(64)))
        elif pick == 1:
            inputs.append(mutate(rng, rng.choice(valid)))
        else:
            inputs.append(wire.encode(random_value(rng)))
    return inputs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(valid_messages()))
def test_decode_raises_only_wire_error(name: str) -> None:
    message_type, valid = valid_messages()[name]
    for data in valid:  # the unmutated messages still decode
        wire.decode(data, message_type)
    refused = 0
    for data in fuzz_inputs(hash(name) & 0xFFFF, valid):
        try:
            wire.decode(data, message_type, max_bytes=1 << 16)
        except WireError:
            refused += 1
    assert refused > MESSAGES // 2  # the fuzzer mostly produces garbage, and it was refused


@pytest.mark.timeout(60)
def test_the_seven_bytes_of_the_issue_are_a_wire_error() -> None:
    for message_type in (HandshakeRequest, Notification, HandshakePayload):
        with pytest.raises(WireError, match="malformed"):
            wire.decode(b"\x95\xa1\x8a\x00\x00\xc4\x00", message_type)


@pytest.mark.timeout(60)
def test_sealed_garbage_is_refused_before_decoding() -> None:
    """With a secret nothing unsigned reaches the decoder: every fuzzed message (random, or
    mutated from a valid sealed one) is refused by its tag."""
    good = seal_notification(SECRET, Notification("done", ["r"], 1))
    assert open_notification(SECRET, good).request_ids == ["r"]
    for data in fuzz_inputs(7, [good]):
        if data == good:
            continue
        with pytest.raises(WireError, match=r"authentication failed|exceeds"):
            wire.unseal(SECRET, NOTIFICATION_DOMAIN, data, max_bytes=1 << 20)
        with pytest.raises(WireError):
            open_notification(SECRET, data)
    # a valid body sealed under another domain or secret is refused too
    body = wire.encode(Notification("done", ["r"], 1))
    with pytest.raises(WireError, match="authentication failed"):
        open_notification(SECRET, wire.seal(SECRET, b"other", body))
    with pytest.raises(WireError, match="authentication failed"):
        open_notification(SECRET, wire.seal("another secret", NOTIFICATION_DOMAIN, body))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("message", "needle"),
    [
        (Notification("done", ["r"], 0), r">= 1 - at `\$\[2\]`"),  # count
        (Notification("done", ["r"], -3), r">= 1 - at `\$\[2\]`"),
        (Notification("done", ["r"], 1 << 20), r"<= 4096 - at `\$\[2\]`"),
        (Notification("done", ["x" * 5000]), r"length <= 1024 - at `\$\[1\]\[0\]`"),  # an id
        (Notification("heartbeat", ["r"] * 10_000), r"length <= 8192 - at `\$\[1\]`"),
    ],
)
def test_out_of_range_notification_fields_are_refused(message: Notification, needle: str) -> None:
    with pytest.raises(WireError, match=needle):
        wire.decode(wire.encode(message), Notification)


@pytest.mark.timeout(60)
def test_out_of_range_handshake_fields_are_refused() -> None:
    region = Region("l", 0, 0, 4096, 8)
    meta = AgentMetadata("P", b"", 0, 0, 1, 1, 4, 16, 16, "HND", "float32", False, [region])
    for bad, needle in [
        (msgspec.structs.replace(meta, tp_size=0), "tp_size"),
        (msgspec.structs.replace(meta, tp_rank=1 << 20), "tp_rank"),
        (msgspec.structs.replace(meta, regions=[]), "regions"),
        (
            msgspec.structs.replace(meta, regions=[Region("l", 0, 0, 4096, 1 << 40)]),
            r"regions\[0\]\[4\]",  # num_blocks
        ),
        (msgspec.structs.replace(meta, regions=[Region("l", 2, 0, 4096, 8)]), r"regions\[0\]\[1\]"),
        (msgspec.structs.replace(meta, engine_id="e" * 5000), "engine_id"),
    ]:
        with pytest.raises(WireError, match=needle):
            wire.decode(wire.encode(bad), AgentMetadata)
    with pytest.raises(WireError, match=r"length >= 16 - at `\$\[3\]`"):  # the nonce
        wire.decode(
            wire.encode(HandshakeRequest("get_meta_msg", 0, 0, b"short", 0.0)), HandshakeRequest
        )


@pytest.mark.timeout(60)
def test_replay_guard_refuses_replays_stale_requests_and_stays_bounded() -> None:
    clock = [1000.0]
    guard = wire.ReplayGuard(window_s=10, max_nonces=100, clock=lambda: clock[0])
    assert guard.check(b"a" * 16, 1000.0) is None
    assert "replayed" in (guard.check(b"a" * 16, 1000.0) or "")
    assert "stale" in (guard.check(b"b" * 16, 980.0) or "")
    assert "stale" in (guard.check(b"b" * 16, float("nan")) or "")
    for i in range(99):
        assert guard.check(i.to_bytes(16, "little"), 1000.0) is None
    assert "too many" in (guard.check(b"c" * 16, 1000.0) or "")
    assert len(guard) == 100
    clock[0] = 1021.0  # two windows later every nonce is forgotten (its timestamp is stale)
    assert guard.check(b"c" * 16, 1021.0) is None
    assert len(guard) == 1
    assert "stale" in (guard.check(b"a" * 16, 1000.0) or "")
