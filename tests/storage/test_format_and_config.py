"""The stored block format (untrusted input), the keys, and the typed extra config."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from kvx.plugins.storage.blockformat import (
    HEADER,
    BlockFormatError,
    BlockShape,
    decode_block,
    encode_block,
)
from kvx.plugins.storage.config import SharedStorageConfig
from kvx.plugins.storage.keys import block_keys, chain_seed, shard_counts

from kvx import ConfigError, KVTransferConfig
from kvx.topology import physical_head_range as rank_heads

MakeRig = Callable[..., Any]  # conftest's Rig factory
SHAPE = BlockShape("bfloat16", 16, 2, 8, range(2, 4), 32)


def block() -> tuple[torch.Tensor, bytes]:
    tensor = torch.arange(16 * 2 * 2 * 32, dtype=torch.float32).view(16, 2, 2, 32)
    tensor = tensor.to(torch.bfloat16)
    return tensor, encode_block("ns/key", SHAPE, tensor)


def test_round_trip_is_exact() -> None:
    tensor, data = block()
    assert len(data) == HEADER.size + 16 * 2 * 2 * 32 * 2
    assert data[:4] == b"KVXB"
    assert torch.equal(decode_block("ns/key", data, SHAPE, verify=True), tensor)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: None, "not stored"),
        (lambda d: d[:20], "shorter than the header"),
        (lambda d: b"XXXX" + d[4:], "magic"),
        (lambda d: d[:4] + struct.pack("<H", 9) + d[6:], "version is 9"),
        (lambda d: d[:-1], "torn"),
        (lambda d: d + b"\0", "torn"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "checksum"),
        (lambda d: d[:8] + bytes([1]) + d[9:], "header dtype is 1, expected 3"),
        (
            lambda d: d[: HEADER.size - 24] + struct.pack("<Q", 1 << 40) + d[HEADER.size - 16 :],
            "payload_len",
        ),
    ],
)
def test_bad_values_are_refused_before_the_payload_is_used(
    mutate: Callable[[bytes], bytes | None], message: str
) -> None:
    _, data = block()
    with pytest.raises(BlockFormatError, match=message):
        decode_block("ns/key", mutate(data), SHAPE, verify=True)


def test_a_value_under_another_key_or_head_range_is_refused() -> None:
    _, data = block()
    with pytest.raises(BlockFormatError, match="checksum"):
        decode_block("ns/other", data, SHAPE, verify=True)
    other = BlockShape("bfloat16", 16, 2, 8, range(0, 2), 32)
    with pytest.raises(BlockFormatError, match="head_start is 2, expected 0"):
        decode_block("ns/key", data, other, verify=False)


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
    assert extra["storage_url"].startswith("file://") and extra["storage_url"].endswith("kvx-kv")
    assert SharedStorageConfig(shared_storage_path="rel").url.startswith("file:///")


def test_storage_block_size_must_fit_the_engine(tmp_path: Path, make_rig: MakeRig) -> None:
    with pytest.raises(ValueError, match="storage_block_size: 24 neither divides nor is a mult"):
        make_rig(f"file://{tmp_path}", extra={"storage_block_size": 24})
    rig = make_rig(f"file://{tmp_path}", block_size=24)  # 16 does not fit: 24 is used instead
    run = rig.prefill("p", list(range(50)))
    assert [len(s.keys) for s in run.metas[0].stores] == [2]
