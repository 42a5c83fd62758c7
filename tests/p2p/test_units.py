"""P2P pieces on their own: addresses and vLLM request ids, config errors, the bounded buffers,
and the claims that depend on send_type."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from kvx import Capability, ConfigError, KVTransferConfig
from kvx.plugins.p2p.addresses import (
    AddressError,
    decode_address_of,
    parse_address,
    parse_legacy_request_id,
)
from kvx.plugins.p2p.buffers import RecvBuffer, SendStore
from kvx.plugins.p2p.connector import P2pNcclConnector, P2pNcclConnectorV1
from kvx.plugins.p2p.messages import TensorMeta
from kvx.plugins.p2p.sender import AsyncSender

LEGACY = "___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001_9f3a-uuid"


def test_legacy_request_id_is_parsed() -> None:
    assert parse_legacy_request_id(LEGACY) == (("10.0.0.1", 21001), ("10.0.0.2", 22001))
    assert parse_legacy_request_id("chatcmpl-123") is None
    assert decode_address_of(LEGACY, None, None) == ("10.0.0.2", 22001)


@pytest.mark.parametrize(
    "bad",
    [
        "___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2_uuid",  # no decode port
        "___prefill_addr_10.0.0.1___decode_addr_10.0.0.2:22001_uuid",  # no prefill port
        "___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001",  # no id after it
        "___prefill_addr_10.0.0.1:99999___decode_addr_10.0.0.2:22001_u",  # port out of range
    ],
)
def test_malformed_legacy_request_id_is_a_clear_error(bad: str) -> None:
    with pytest.raises(AddressError, match=r"___prefill_addr_|port 1-65535"):
        parse_legacy_request_id(bad)


def test_address_sources_in_order() -> None:
    params = {"decode_address": "[::1]:7000"}
    assert decode_address_of(LEGACY, params, "h:1") == ("::1", 7000)
    assert decode_address_of("plain", None, "decode-0:31000") == ("decode-0", 31000)
    assert decode_address_of("plain", {}, None) is None
    with pytest.raises(AddressError, match=r"decode_address: 'nope' is not 'host:port'"):
        parse_address("nope", "kv_transfer_params.decode_address")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"send_type": "PUSH"}, 'send_type: "PUSH".*allowed: "GET", "PUT", "PUT_ASYNC"'),
        ({"data_plane": "gpu"}, 'data_plane: "gpu".*allowed: "auto", "cpu", "nccl"'),
        ({"default_decode_address": "10.0.0.2"}, r"default_decode_address.*'10.0.0.2'.*host:port"),
        ({"mem_pool_size_gb": -1}, r"mem_pool_size_gb.*-1.*>= 0"),
        ({"proxy_ip": "127.0.0.1"}, r"proxy_port.*set both"),
        ({"proxy_ip": "127.0.0.1", "proxy_port": 30001}, r"http_port: required"),
        ({"sendtype": "PUT"}, r"sendtype.*send_type"),
    ],
)
def test_config_errors_name_key_value_and_allowed(extra: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        KVTransferConfig.from_dict(
            {
                "kv_connector": "P2pNcclConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": extra,
            }
        )


def test_claims_follow_send_type() -> None:
    assert P2pNcclConnectorV1 is P2pNcclConnector
    for send_type, is_async in (("PUT", False), ("PUT_ASYNC", False), ("GET", True)):
        config = KVTransferConfig.from_dict(
            {
                "kv_connector": "P2pNcclConnectorV1",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"send_type": send_type},
            }
        )
        claims = P2pNcclConnector.claims_for(config)
        assert (Capability.ASYNC_LOAD in claims) is is_async
        assert {Capability.REMOTE_PREFILL, Capability.HETERO_TP} <= claims


def _meta(request_id: str, nbytes: int, layer: str = "l0") -> TensorMeta:
    return TensorMeta(request_id, layer, 0, 0, 1, 4, 4, 1, 4, "NHD", "float32", nbytes)


def test_receive_buffer_spills_then_refuses_and_releases() -> None:
    buffer = RecvBuffer(device_bytes=100, pool_bytes=100, ttl_s=60)
    assert buffer.admit(_meta("a", 64)) is None
    buffer.put(("a", "l0", 0), _meta("a", 64), [torch.zeros(16)], spill=False)
    assert buffer.admit(_meta("b", 64)) == "spill"  # over kv_buffer_size: into the pool
    buffer.put(("b", "l0", 0), _meta("b", 64), [torch.ones(16)], spill=True)
    refusal = buffer.admit(_meta("c", 64))
    assert refusal is not None and "kv_buffer_size 100" in refusal and "mem_pool_size_gb" in refusal
    # a refused request fails at once instead of waiting for its KV
    assert "refused" in (buffer.wait_for([("c", "l0", 0)], "c", time.monotonic() + 30) or "")
    _, [tensor] = buffer.take(("b", "l0", 0), torch.device("cpu"))
    assert torch.equal(tensor, torch.ones(16)) and buffer.used_bytes == 64
    assert buffer.discard("a") == 1 and buffer.used_bytes == 0
    assert buffer.admit(_meta("d", 64)) is None  # room again


def test_receive_buffer_times_out_and_expires() -> None:
    buffer = RecvBuffer(device_bytes=100, pool_bytes=0, ttl_s=0.05)
    assert buffer.admit(_meta("a", 8)) is None
    buffer.put(("a", "l0", 0), _meta("a", 8), [torch.zeros(2)], spill=False)
    why = buffer.wait_for([("z", "l0", 0)], "z", time.monotonic() + 0.05)
    assert why is not None and "never arrived" in why
    time.sleep(0.1)
    buffer.expire()
    assert len(buffer) == 0 and buffer.used_bytes == 0


def test_send_store_evicts_fifo_and_drops_after_all_readers() -> None:
    store = SendStore(max_bytes=100, ttl_s=60)
    for name in "abc":
        assert store.put(_meta(name, 40), torch.zeros(10))
    assert store.lookup("a", "l0") is None and store.evicted == 1  # oldest went first
    assert store.lookup("b", "l0") is not None and store.used_bytes == 80
    assert not store.put(_meta("huge", 101), torch.zeros(1))  # larger than the whole budget
    store.served("b", "l0", readers=2)
    assert store.lookup("b", "l0") is not None
    store.served("b", "l0", readers=2)
    assert store.lookup("b", "l0") is None and store.used_bytes == 40
    store.discard("c")
    assert len(store) == 0 and store.used_bytes == 0


def test_a_consumer_loads_from_the_prefill_address_of_a_vllm_request_id() -> None:
    from kvx import EngineContext, KVCacheSpec, Request
    from kvx.plugins.p2p.config import P2pConfig
    from kvx.plugins.p2p.scheduler import load_source

    config = KVTransferConfig.from_dict(
        {"kv_connector": "P2pNcclConnector", "kv_role": "kv_consumer"}
    )
    ctx = EngineContext("d", "m", KVCacheSpec(("l0",), 2, 4, 16))
    source = load_source(Request(LEGACY, [1, 2, 3]), config, P2pConfig(send_type="GET"), ctx)
    assert source is not None
    assert (source.host, source.port, source.remote_request_id) == ("10.0.0.1", 21001, LEGACY)
    assert (source.tp_size, source.mode, source.num_tokens) == (1, "GET", 3)
    bad = Request("___prefill_addr_10.0.0.1___decode_addr_x:1_u", [1])
    assert load_source(bad, config, P2pConfig(), ctx) is None  # logged, never raised


def test_stats_cross_a_process_boundary_by_value() -> None:
    """vLLM pickles connector stats from worker to engine core (its own IPC, not a kvx wire);
    the lock stays behind and the receiver can still count."""
    import pickle

    from kvx.plugins.p2p.stats import P2pKVConnectorStats

    stats = P2pKVConnectorStats()
    stats.count("puts", 3)
    stats.record(0.5, "sent")
    copy = pickle.loads(pickle.dumps(stats.clone_and_reset()))
    assert copy.data["puts"] == 3
    assert copy.data["transfer_duration"] == [0.5]
    copy.count("puts")
    assert copy.data["puts"] == 4
    assert stats.data["puts"] == 0


@pytest.mark.parametrize("send_type", ["PUT", "PUT_ASYNC", "GET"])
def test_d_loads_from_its_local_hit_whatever_blocks_vllm_hashed(send_type: str) -> None:
    """A synchronous load (PUT modes) leaves vLLM one prompt token to compute, and every load
    starts at the local prefix hit vLLM offered. vLLM hashes a synchronous load's blocks as
    soon as it allocates them, so counting hashed blocks put the start after the load's own
    blocks (under `vllm serve`: "the peer sent 129 tokens, 256 are needed")."""
    from kvx import EngineContext, KVCacheBlocks, KVCacheSpec, Request
    from kvx.plugins.p2p.config import P2pConfig
    from kvx.plugins.p2p.scheduler import P2pScheduler

    config = KVTransferConfig.from_dict(
        {"kv_connector": "P2pNcclConnector", "kv_role": "kv_consumer", "kv_port": 0}
    )
    ctx = EngineContext("d", "m", KVCacheSpec(("l0",), 2, 4, 16))
    scheduler = P2pScheduler(P2pConfig(send_type=send_type), config, ctx)
    params = {
        "do_remote_prefill": True,
        "remote_request_id": "p-req",
        "remote_address": "127.0.0.1:21001",
        "remote_tp_size": 1,
        "remote_pp_size": 1,
        "remote_num_tokens": 129,
        "send_type": send_type,
    }
    request = Request("d-req", list(range(4, 133)), kv_transfer_params=params)  # 129 tokens
    sync = send_type != "GET"
    want = 129 - 32 - (1 if sync else 0)  # two blocks (32 tokens) were a local prefix hit
    assert scheduler.get_num_new_matched_tokens(request, 32) == (want, not sync)
    blocks = list(range(100, 109))  # 9 blocks of 16 hold 129 tokens
    hashed = 8 if sync else 2  # vLLM hashes every full block of a synchronous load at once
    scheduler.update_state_after_alloc(request, KVCacheBlocks((blocks,), (hashed,)), want)
    (load,) = scheduler.build_connector_meta(_empty_step()).loads
    assert (load.start_token, load.num_tokens) == (32, want)
    assert load.block_ids == blocks[2 : -(-(32 + want) // 16)]


def _empty_step() -> Any:
    from kvx import SchedulerOutput

    return SchedulerOutput()


def test_async_sender_cancel_drops_what_has_not_started() -> None:
    """wait_for_save's fallback: after a drain timeout the queued sends (whose frames would read
    blocks vLLM may reuse) are dropped, the one in flight finishes."""
    release, started, sent = threading.Event(), threading.Event(), []

    def send(item: int) -> None:
        started.set()
        release.wait(10)
        sent.append(item)

    sender = AsyncSender(send, "test-sender")
    try:
        for item in range(4):
            sender.submit(item)
        assert started.wait(10)
        assert not sender.drain(0.05)
        assert sender.cancel() == 3
        release.set()
        assert sender.drain(10) and sent == [0]
    finally:
        release.set()
        sender.close()


def test_nccl_settings_hold_only_while_a_communicator_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NCCL_MIN/MAX_NCHANNELS and NCCL_CUMEM_ENABLE are set around ncclCommInitRank and the
    process's own values come back after the last concurrent user (vLLM's groups keep theirs)."""
    from kvx.plugins.p2p.nccl import nccl_env

    monkeypatch.setenv("NCCL_MAX_NCHANNELS", "2")
    monkeypatch.delenv("NCCL_MIN_NCHANNELS", raising=False)
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    import os

    with nccl_env(8):
        with nccl_env(8):
            assert os.environ["NCCL_MIN_NCHANNELS"] == "8"
        assert (os.environ["NCCL_MAX_NCHANNELS"], os.environ["NCCL_CUMEM_ENABLE"]) == ("8", "1")
    assert os.environ["NCCL_MAX_NCHANNELS"] == "2"
    assert "NCCL_MIN_NCHANNELS" not in os.environ and "NCCL_CUMEM_ENABLE" not in os.environ
