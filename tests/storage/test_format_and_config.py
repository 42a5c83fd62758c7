"""The stored block format (untrusted input), the keys, and the typed extra config."""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from kvx import ConfigError, KVTransferConfig
from kvx.layouts import CPU_PACKED, HND, MLA, NHD
from kvx.plugins.storage.blockformat import (
    HEADER,
    BlockFormatError,
    BlockShape,
    block_order,
    check_value,
    decode_block,
    encode_block,
    stored_layout,
)
from kvx.plugins.storage.config import SharedStorageConfig
from kvx.plugins.storage.keys import block_keys, chain_seed, shard_counts
from kvx.storage.userdirs import user_cache_dir
from kvx.topology import physical_head_range as rank_heads

MakeRig = Callable[..., Any]  # conftest's Rig factory
SHAPE = BlockShape(  # layers 4-5 of 8, heads 2-3 of 8: one stage's value for one head shard
    "bfloat16", 16, 2, 8, range(2, 4), 32, layers=range(4, 6), total_layers=8, layer_set=b"8bytes!!"
)


def block() -> tuple[torch.Tensor, bytes]:
    tensor = torch.arange(2 * 2 * 16 * 2 * 32, dtype=torch.float32).view(2, 2, 16, 2, 32)
    tensor = tensor.to(torch.bfloat16)
    return tensor, encode_block("ns/key", SHAPE, tensor)


def test_round_trip_is_exact() -> None:
    tensor, data = block()
    assert HEADER.size == 64  # the payload is aligned for every dtype
    assert len(data) == HEADER.size + 2 * 16 * 2 * 2 * 32 * 2
    assert data[:4] == b"KVXB" and struct.unpack_from("<H", data, 4) == (3,)
    assert data[12:20] == b"kthdkthd"  # NHD's per-block order, for K and V alike
    assert torch.equal(decode_block("ns/key", data, SHAPE, verify=True), tensor)
    digest = xxhash.xxh3_64(b"ns/key" + data[: HEADER.size - 8] + data[HEADER.size :])
    assert struct.unpack_from("<Q", data, HEADER.size - 8)[0] == digest.intdigest()


def test_the_stored_order_is_the_writers_block_order() -> None:
    assert block_order(NHD) == ("kthd", "kthd")
    assert block_order(HND) == ("khtd", "khtd")
    assert block_order(MLA) == ("td", "td")
    assert block_order(CPU_PACKED) == ("hktd", "hkdt")  # vLLM-CPU keeps K transposed
    assert stored_layout("khtd", "khtd").memory == ("blocks", "kv", "heads", "tokens", "head_size")
    # A reader accepts any order of its dims and learns it from the header.
    hnd = replace(SHAPE, order="khtd")
    tensor = torch.zeros(hnd.tensor_shape, dtype=torch.bfloat16)
    stored, _ = check_value("k", encode_block("k", hnd, tensor), SHAPE, verify=True)
    assert stored.order == "khtd" and stored.layout.name == "KVX_STORED_khtd"


def _with(data: bytes, offset: int, fmt: str, value: object) -> bytes:
    return data[:offset] + struct.pack(fmt, value) + data[offset + struct.calcsize(fmt) :]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: None, "not stored"),
        (lambda d: d[:20], "shorter than the header"),
        (lambda d: b"XXXX" + d[4:], "magic"),
        (lambda d: _with(d, 4, "<H", 9), "version is 9"),
        (lambda d: _with(d, 4, "<H", 2), "version is 2, expected 3"),  # a token-major v2 value
        (lambda d: d[:-1], "torn"),
        (lambda d: d + b"\0", "torn"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "checksum"),
        (lambda d: d[:8] + bytes([1]) + d[9:], "header dtype is 1, expected 3"),
        (lambda d: _with(d, 34, "<H", 0), "layer_start is 0, expected 4"),
        (lambda d: _with(d, 38, "<H", 32), "total_layers is 32, expected 8"),
        (lambda d: _with(d, 40, "8s", b"another!"), "layer_set"),
        (lambda d: _with(d, 48, "<Q", 1 << 40), "payload_len"),
        (lambda d: _with(d, 12, "4s", b"kkhd"), "order is 'kkhd'"),
        (lambda d: _with(d, 16, "4s", b"tkhd"), "k_order 'tkhd' does not fit"),
    ],
)
def test_bad_values_are_refused_before_the_payload_is_used(
    mutate: Callable[[bytes], bytes | None], message: str
) -> None:
    _, data = block()
    with pytest.raises(BlockFormatError, match=message):
        decode_block("ns/key", mutate(data), SHAPE, verify=True)


def test_a_value_under_another_key_head_range_or_stage_is_refused() -> None:
    _, data = block()
    with pytest.raises(BlockFormatError, match="checksum"):
        decode_block("ns/other", data, SHAPE, verify=True)
    other = replace(SHAPE, heads=range(0, 2))
    with pytest.raises(BlockFormatError, match="head_start is 2, expected 0"):
        decode_block("ns/key", data, other, verify=False)
    with pytest.raises(BlockFormatError, match="layer_end is 6, expected 8"):
        decode_block("ns/key", data, replace(SHAPE, layers=range(4, 8)), verify=False)


def test_keys_chain_the_prefix_and_namespace() -> None:
    seed = chain_seed("ns", 16)
    a = block_keys(list(range(50)), 16, seed)
    b = block_keys(list(range(32)) + [7] * 18, 16, seed)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert block_keys(list(range(50)), 16, chain_seed("other", 16))[0] != a[0]
    assert block_keys(list(range(50)), 16, chain_seed("ns", 16, ["img"]))[0] != a[0]
    # A change in block 0 changes every later key.
    assert set(block_keys([1, *range(1, 50)], 16, seed)).isdisjoint(a)


def test_head_shards() -> None:
    assert [rank_heads(8, 4, r) for r in range(4)] == [range(2 * r, 2 * r + 2) for r in range(4)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert shard_counts(8, preferred=4) == [4, 1, 2, 8]


def config(extra: dict[str, Any]) -> KVTransferConfig:
    return KVTransferConfig.from_dict(
        {
            "kv_connector": "SharedStorageConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"storage_urll": "file:///x"}, "storage_urll"),
        ({"storage_url": "/tmp/kv"}, "not a URL of the form scheme://"),
        ({"storage_url": "s4://bucket/kv"}, "no storage backend for URL scheme 's4'"),
        ({"storage_url": "file:///x", "redis_ttl_s": 10}, "redis_ttl_s: only redis://"),
        ({"redis_ttl_s": 0}, "redis_ttl_s"),
        ({"storage_url": "file:///x", "redis_client": "redis-py"}, "redis_client: only redis://"),
        ({"redis_client": "hiredis"}, "redis_client"),
        ({"namespace": "a/b"}, "namespace: 'a/b' is not allowed"),
        ({"io_threads": 0}, "io_threads"),
        ({"storage_url": "file:///a", "shared_storage_path": "/b"}, "not both"),
    ],
)
def test_bad_config_is_a_clear_error(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config(extra)
    text = str(info.value)
    assert "kv_connector_extra_config" in text and message in text, text


def test_defaults_are_filled_in() -> None:
    extra = config({}).kv_connector_extra_config
    assert extra["storage_url"] == "file://" + user_cache_dir("kv")  # the user's own
    assert not extra["storage_url"].startswith("file:///tmp/")
    assert SharedStorageConfig(shared_storage_path="rel").url.startswith("file:///")


def test_storage_block_size_must_fit_the_engine(tmp_path: Path, make_rig: MakeRig) -> None:
    with pytest.raises(ValueError, match="storage_block_size: 24 neither divides nor is a mult"):
        make_rig(f"file://{tmp_path}", extra={"storage_block_size": 24})
    rig = make_rig(f"file://{tmp_path}", block_size=24)  # 16 does not fit: 24 is used instead
    run = rig.prefill("p", list(range(50)))
    assert [len(s.keys) for s in run.metas[0].stores] == [2]
