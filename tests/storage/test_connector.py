"""SharedStorageConnector through the contract: what is stored, what loads, byte for byte."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from kvx import (
    CachedRequestData,
    KVCacheBlocks,
    NewRequestData,
    Request,
    SchedulerOutput,
)
from kvx.plugins.storage.backends import segments
from kvx.plugins.storage.keys import Stage, block_keys, chain_seed, layer_set_hash, value_key

pytestmark = pytest.mark.timeout(60)

MakeRig = Callable[..., Any]  # conftest's Rig factory
NAMESPACE = "test-ns"  # the rig's namespace
LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")  # the rig's layers
STAGE = Stage(range(2), layer_set_hash(LAYERS))  # one value holds both layers of a block
VALUE = f"{STAGE.tag}.h0-4"  # a block's value file is `<key>.<VALUE>` (one shard of 4 heads)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_store_then_load_byte_exact(storage_url: str, make_rig: MakeRig) -> None:
    tokens = prompt(50)
    producer = make_rig(storage_url)
    stored = producer.prefill("p", tokens)
    assert stored.num_external == 0
    assert [s.keys for s in stored.metas[0].stores] == [
        block_keys(tokens, 16, chain_seed(NAMESPACE, 16))[:3]
    ]
    producer.check(tokens, stored.block_ids, len(tokens))

    consumer = make_rig(storage_url)
    loaded = consumer.prefill("d", tokens, compute=False)
    assert loaded.num_external == 48  # three full blocks; the partial fourth is never stored
    assert loaded.errors == [set()]
    consumer.check(tokens, loaded.block_ids, 48)


def test_matching_is_idempotent_and_never_claims_the_last_token(
    storage_url: str, make_rig: MakeRig
) -> None:
    tokens = prompt(64, seed=1)
    make_rig(storage_url).prefill("p", tokens)
    rig = make_rig(storage_url)
    request = Request("d", tokens)
    answers = {rig.scheduler.get_num_new_matched_tokens(request, 0) for _ in range(3)}
    assert answers == {(48, False)}  # 4 blocks stored, but token 63 must be recomputed
    assert rig.scheduler.get_num_new_matched_tokens(request, 32) == (16, False)
    assert rig.scheduler.get_num_new_matched_tokens(request, 48) == (0, False)
    assert rig.scheduler.get_num_new_matched_tokens(Request("x", tokens[:16]), 0) == (0, False)
    meta = rig.scheduler.build_connector_meta(SchedulerOutput())
    assert meta.loads == [] and meta.stores == []  # asking had no side effect


def test_shared_prefix_is_stored_once(tmp_path: Path, make_rig: MakeRig) -> None:
    url = f"file://{tmp_path}"
    first = prompt(64, seed=2)
    second = first[:40] + prompt(40, seed=3)
    rig = make_rig(url)
    rig.prefill("a", first)
    run = rig.prefill("b", second)
    assert run.num_external == 32  # the two shared full blocks
    stored = {s for m in run.metas for spec in m.stores for s in spec.keys}
    keys_a = block_keys(first, 16, chain_seed(NAMESPACE, 16))
    keys_b = block_keys(second, 16, chain_seed(NAMESPACE, 16))
    assert keys_a[:2] == keys_b[:2] and keys_a[2] != keys_b[2]
    assert stored == set(keys_b[2:5])  # b stores only what it computed
    blocks = {p.name.split(".")[0] for p in tmp_path.rglob(f"*.{VALUE}")}
    assert blocks == set(keys_a) | set(keys_b)  # 4 + 3 distinct blocks, prefix shared
    rig.check(second, run.block_ids, len(second), alone=False)


def test_partial_prefix_hit_loads_what_exists(tmp_path: Path, make_rig: MakeRig) -> None:
    url = f"file://{tmp_path}"
    tokens = prompt(100, seed=4)
    make_rig(url).prefill("p", tokens[:64])
    rig = make_rig(url)
    run = rig.prefill("d", tokens, compute=False)
    assert run.num_external == 64  # the stored 4 blocks of a 6-block prompt
    rig.check(tokens, run.block_ids, 64)
    # A hole in the middle: only the prefix before it counts.
    key = block_keys(tokens, 16, chain_seed(NAMESPACE, 16))[2]
    next(tmp_path.rglob(f"{key}.{VALUE}")).unlink()
    assert rig.scheduler.get_num_new_matched_tokens(Request("e", tokens), 0) == (32, False)


def test_local_prefix_hit_loads_only_the_rest(storage_url: str, make_rig: MakeRig) -> None:
    tokens = prompt(80, seed=5)
    make_rig(storage_url).prefill("p", tokens)
    rig = make_rig(storage_url)
    run = rig.prefill("d", tokens, compute=False, num_computed=32)
    assert run.num_external == 32  # tokens 32..63; 0..31 were a local hit
    (load,) = run.metas[0].loads
    assert (load.start, load.num_tokens, load.block_ids) == (32, 32, run.block_ids[2:4])


def corrupt_file(tmp_path: Path, key: str) -> None:
    """Flip a bit in the middle of the block's value (in its own file or its segment file)."""
    path = next(tmp_path.rglob(f"{key}.{VALUE}"))
    data = bytearray(path.read_bytes())
    with path.open("rb") as f:
        name = path.relative_to(tmp_path).as_posix()
        where = segments.locate(f.fileno(), len(data), name)
    start, length = (where.offset, where.length) if where else (0, len(data))
    data[start + length // 2] ^= 0x40  # in the payload
    path.write_bytes(bytes(data))


def corrupt_redis(url: str, key: str) -> None:
    client = redis.Redis.from_url(url)
    name = "kvx/" + value_key(NAMESPACE, 16, key, STAGE, range(4))
    data = client.get(name)
    assert data is not None
    client.setrange(name, len(data) // 2, bytes([data[len(data) // 2] ^ 0x40]))
    client.close()


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_corruption_is_reported_as_load_errors(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest, make_rig: MakeRig
) -> None:
    url = f"file://{tmp_path}" if backend == "file" else request.getfixturevalue("redis_url")
    tokens = prompt(80, seed=6)
    make_rig(url).prefill("p", tokens)
    key = block_keys(tokens, 16, chain_seed(NAMESPACE, 16))[1]
    if backend == "file":
        corrupt_file(tmp_path, key)
    else:
        corrupt_redis(url, key)
    rig = make_rig(url)
    run = rig.prefill("d", tokens, compute=False)
    assert run.num_external == 64  # the header is intact: the scheduler cannot tell
    # Block 1 is bad, so blocks 2 and 3 (a prefix is valid only up to its first bad block).
    assert run.errors == [set(run.block_ids[1:4])]
    # Block 0 loaded exactly; nothing written outside the request's failed blocks.
    rig.check(tokens, run.block_ids[:1], 16, failed=run.block_ids[1:4])


def test_a_bad_block_fails_only_its_own_request_in_a_shared_step(
    tmp_path: Path, make_rig: MakeRig
) -> None:
    # Both requests' values are read and scattered together (one group per layer); the
    # corrupt block of "a" must not cost "b" anything.
    url = f"file://{tmp_path}"
    a, b = prompt(80, seed=10), prompt(80, seed=11)
    producer = make_rig(url)
    producer.prefill("pa", a)
    producer.prefill("pb", b)
    corrupt_file(tmp_path, block_keys(a, 16, chain_seed(NAMESPACE, 16))[1])
    rig = make_rig(url, role="kv_consumer")
    new, blocks = [], {}
    for req_id, tokens in (("a", a), ("b", b)):
        request = Request(req_id, tokens)
        rig.scheduler.on_new_request(request)
        assert rig.scheduler.get_num_new_matched_tokens(request, 0) == (64, False)
        blocks[req_id] = rig.allocate(len(tokens))
        alloc = KVCacheBlocks((blocks[req_id],), (0,))
        rig.scheduler.update_state_after_alloc(request, alloc, 64)
        new.append(NewRequestData(req_id, tokens, (blocks[req_id],), 64))
    out = SchedulerOutput(scheduled_new_reqs=new, num_scheduled_tokens={"a": 16, "b": 16})
    errors, meta = rig.step(out, {})
    assert len(meta.loads) == 2 and not meta.stores
    assert errors == set(blocks["a"][1:4])  # a's block 1 is bad, so are its blocks 2 and 3
    rig.check(b, blocks["b"], 64, alone=False)
    rig.check(a, blocks["a"][:1], 16, alone=False)


def test_checksums_can_be_skipped(tmp_path: Path, make_rig: MakeRig) -> None:
    url = f"file://{tmp_path}"
    tokens = prompt(40, seed=7)
    make_rig(url).prefill("p", tokens)
    corrupt_file(tmp_path, block_keys(tokens, 16, chain_seed(NAMESPACE, 16))[0])
    run = make_rig(url, extra={"verify_checksums": False}).prefill("d", tokens, compute=False)
    assert run.errors == [set()]


def test_missing_value_is_a_load_error(tmp_path: Path, make_rig: MakeRig) -> None:
    url = f"file://{tmp_path}"
    tokens = prompt(50, seed=8)
    make_rig(url).prefill("p", tokens)
    rig = make_rig(url)
    request = Request("d", tokens)
    assert rig.scheduler.get_num_new_matched_tokens(request, 0) == (48, False)
    for path in tmp_path.rglob(f"*.{VALUE}"):  # another engine's TTL / eviction after the match
        path.unlink()
    blocks = rig.allocate(len(tokens))
    rig.scheduler.update_state_after_alloc(request, KVCacheBlocks((blocks,), (0,)), 48)
    out = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("d", tokens, (blocks,), 48)],
        num_scheduled_tokens={"d": 2},
    )
    errors, _ = rig.step(out, {})
    assert errors == set(blocks[:3])


@pytest.mark.parametrize(
    ("p", "d"),
    [
        ({"tp": 2}, {"tp": 1}),
        ({"tp": 1}, {"tp": 2}),
        ({"tp": 4}, {"tp": 2, "layout": "HND"}),
        ({"tp": 4, "heads": 2}, {"tp": 1, "heads": 2}),  # P replicates heads over ranks
        ({"tp": 1, "heads": 2}, {"tp": 4, "heads": 2}),  # D replicates heads over ranks
        ({"layout": "HND"}, {"layout": "CPU_PACKED"}),
        ({"layout": "CPU_PACKED"}, {"layout": "CPU_PACKED"}),  # direct, K and V orders differ
        ({"layout": "CPU_PACKED"}, {"layout": "NHD", "block_size": 8}),  # cut a split order
        ({"layout": "CPU_PACKED", "block_size": 8}, {"layout": "CPU_PACKED", "tp": 2}),
        ({"mla": True}, {"mla": True}),  # direct MLA
        ({"layout": "FLASHINFER_NHD"}, {"layout": "FLASHINFER_HND", "tp": 2}),
        ({"block_size": 16}, {"block_size": 32}),
        ({"block_size": 32, "tp": 2}, {"block_size": 16}),
        ({"block_size": 8}, {"block_size": 32, "layout": "HND"}),
        ({"mla": True, "tp": 2}, {"mla": True, "tp": 1, "block_size": 32}),
        ({"dtype": "bfloat16", "tp": 2}, {"dtype": "bfloat16", "tp": 4}),
    ],
)
def test_loads_across_tp_layout_and_block_size(
    p: dict[str, object], d: dict[str, object], tmp_path: Path, make_rig: MakeRig
) -> None:
    url = f"file://{tmp_path}"
    tokens = prompt(75, seed=9)
    producer = make_rig(url, **p)
    producer.prefill("p", tokens)
    consumer = make_rig(url, **d)
    run = consumer.prefill("d", tokens, compute=False)
    stored = len(tokens) // 16 * 16  # full stored blocks of 16 tokens
    expected = min(stored, (len(tokens) - 1) // consumer.block_size * consumer.block_size)
    assert run.num_external == expected
    assert run.errors == [set()]
    consumer.check(tokens, run.block_ids, expected)


@pytest.mark.parametrize(
    "reader",
    [
        {"layout": "NHD"},
        {"layout": "CPU_PACKED"},
        {"layout": "NHD", "block_size": 32},  # both orders in one engine block
        {"layout": "HND", "block_size": 8, "tp": 2},
    ],
)
def test_a_prefix_stored_by_engines_of_different_layouts_loads(
    reader: dict[str, object], tmp_path: Path, make_rig: MakeRig
) -> None:
    # Blocks 0-2 stored by an NHD engine, block 3 by an HND engine (which loaded 0-2): each
    # value names its own element order, and a reader converts each from its own.
    url = f"file://{tmp_path}"
    tokens = prompt(80, seed=12)
    make_rig(url).prefill("p1", tokens[:49])
    second = make_rig(url, layout="HND").prefill("p2", tokens)
    assert second.num_external == 48
    rig = make_rig(url, **reader)
    run = rig.prefill("d", tokens, compute=False)
    expected = (len(tokens) - 1) // rig.block_size * rig.block_size  # all 5 blocks are stored
    assert run.num_external == expected and run.errors == [set()]
    rig.check(tokens, run.block_ids, expected)


def test_tp2_store_then_tp1_load_redis(redis_url: str, make_rig: MakeRig) -> None:
    tokens = prompt(70, seed=10)
    make_rig(redis_url, tp=2).prefill("p", tokens)
    rig = make_rig(redis_url, tp=1)
    run = rig.prefill("d", tokens, compute=False)
    assert run.num_external == 64 and run.errors == [set()]
    rig.check(tokens, run.block_ids, 64)


def test_different_model_shape_never_hits(tmp_path: Path, make_rig: MakeRig) -> None:
    url = f"file://{tmp_path}"
    tokens = prompt(40, seed=11)
    make_rig(url, extra={"namespace": "model-a"}).prefill("p", tokens)
    rig = make_rig(url, extra={"namespace": "model-b"})
    assert rig.scheduler.get_num_new_matched_tokens(Request("d", tokens), 0) == (0, False)


def test_chunked_prefill_stores_blocks_as_they_complete(
    storage_url: str, make_rig: MakeRig
) -> None:
    tokens = prompt(70, seed=12)
    rig = make_rig(storage_url)
    run = rig.prefill("p", tokens, chunk=24)
    keys = block_keys(tokens, 16, chain_seed(NAMESPACE, 16))
    per_step = [[k for spec in m.stores for k in spec.keys] for m in run.metas]
    # Steps cover tokens 0-24, 24-48, 48-70: blocks complete at 16, 32/48, 64; 64-70 is partial.
    assert per_step == [keys[0:1], keys[1:3], keys[3:4]]
    loaded = make_rig(storage_url).prefill("d", tokens, compute=False)
    assert loaded.num_external == 64
    rig.check(tokens, run.block_ids, len(tokens))


def test_consumer_does_not_store(tmp_path: Path, make_rig: MakeRig) -> None:
    run = make_rig(f"file://{tmp_path}", role="kv_consumer").prefill("d", prompt(40))
    assert all(not m.stores for m in run.metas)
    assert not list(tmp_path.rglob(f"*.{VALUE}"))


def test_resumed_request_reloads_into_its_new_blocks(storage_url: str, make_rig: MakeRig) -> None:
    tokens = prompt(50, seed=13)
    make_rig(storage_url).prefill("p", tokens)
    rig = make_rig(storage_url)
    request = Request("d", tokens)
    n, _ = rig.scheduler.get_num_new_matched_tokens(request, 0)
    old = rig.allocate(len(tokens))
    rig.scheduler.update_state_after_alloc(request, KVCacheBlocks((old,), (0,)), n)
    rig.step(
        SchedulerOutput(
            scheduled_new_reqs=[NewRequestData("d", tokens, (old,), n)],
            num_scheduled_tokens={"d": len(tokens) - n},
        ),
        {},
    )
    # Preempted: its blocks are freed; when it resumes it matches again, gets a new table.
    rig.step(SchedulerOutput(preempted_req_ids={"d"}), {})
    n2, _ = rig.scheduler.get_num_new_matched_tokens(request, 0)
    new = rig.allocate(len(tokens))
    rig.scheduler.update_state_after_alloc(request, KVCacheBlocks((new,), (0,)), n2)
    errors, meta = rig.step(
        SchedulerOutput(
            scheduled_cached_reqs=CachedRequestData(
                req_ids=["d"],
                resumed_req_ids={"d"},
                new_token_ids=[[]],
                all_token_ids={"d": tokens},
                new_block_ids=[(new,)],
                num_computed_tokens=[n2],
            ),
            num_scheduled_tokens={"d": len(tokens) - n2},
        ),
        {},
    )
    assert n2 == 48 and errors == set()
    assert meta.loads[0].block_ids == new[:3]
    for _, caches, _ in rig.workers:  # both tables hold the prefix now
        view = rig.token_view(caches[LAYERS[0]])
        assert all(view[new[i]].equal(view[old[i]]) for i in range(3))


@pytest.mark.parametrize(
    ("p", "d"),
    [
        ({"block_size": 32}, {"block_size": 32}),
        ({"block_size": 64}, {"block_size": 16}),
        ({"block_size": 16}, {"block_size": 64}),
        ({"block_size": 32, "layout": "HND"}, {"block_size": 32}),
    ],
)
def test_token_major_engine_blocks_move_straight_in_stored_block_pieces(
    p: dict[str, object], d: dict[str, object], tmp_path: Path, make_rig: MakeRig
) -> None:
    # An NHD engine block of 32 or 64 tokens is 2 or 4 stored 16-token blocks, each a
    # contiguous piece of every region: read and written without buffers (direct); HND is not.
    url = f"file://{tmp_path}"
    tokens = prompt(150, seed=11)
    producer = make_rig(url, **p)
    producer.prefill("p", tokens)
    consumer = make_rig(url, **d)
    for rig, spec in ((producer, p), (consumer, d)):
        assert rig.workers[0][0].worker.direct == (spec.get("layout", "NHD") == "NHD")
    run = consumer.prefill("d", tokens, compute=False)
    expected = min(144, (len(tokens) - 1) // consumer.block_size * consumer.block_size)
    assert run.num_external == expected and run.errors == [set()]
    consumer.check(tokens, run.block_ids, expected)


def test_a_direct_save_is_one_segment_per_io_thread(
    tmp_path: Path, make_rig: MakeRig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one IO thread, a step's values go into one segment file (one new inode) even
    when they span several write groups; every value loads back byte for byte."""
    from kvx.plugins.storage import worker

    monkeypatch.setattr(worker, "GROUP_BYTES", 1)  # a group per value without one job a thread
    url = f"file://{tmp_path}"
    tokens = prompt(100, seed=11)
    producer = make_rig(url, extra={"io_threads": 1})
    run = producer.prefill("p", tokens)
    files = sorted(tmp_path.rglob(f"*.{VALUE}"))
    assert len(files) == 6  # six full blocks
    inodes = {f.stat().st_ino for f in files}
    assert len(inodes) == 1 and files[0].stat().st_nlink == 6
    producer.check(tokens, run.block_ids, len(tokens))
    consumer = make_rig(url, extra={"io_threads": 1})
    loaded = consumer.prefill("d", tokens, compute=False)
    assert loaded.num_external == 96 and loaded.errors == [set()]
    consumer.check(tokens, loaded.block_ids, 96)


@pytest.mark.parametrize("io_threads", [1, 2])
def test_direct_loads_with_one_io_thread_are_one_read_on_the_loading_thread(
    tmp_path: Path, make_rig: MakeRig, monkeypatch: pytest.MonkeyPatch, io_threads: int
) -> None:
    """Direct reads have no scatter to overlap: with one IO thread a load's values are one
    native read on the thread that loads (no hand-off), whatever READ_BYTES says; with more
    IO threads they are read on them, in units of READ_BYTES. A bad block fails its load
    from there on either way."""
    from kvx.plugins.storage import worker
    from kvx.plugins.storage.backends.local_files import LocalFileBackend

    url = f"file://{tmp_path}"
    tokens = prompt(100, seed=12)  # six full blocks
    make_rig(url).prefill("p", tokens)
    corrupt_file(tmp_path, block_keys(tokens, 16, chain_seed(NAMESPACE, 16))[2])
    monkeypatch.setattr(worker, "READ_BYTES", 1)  # a unit per value (with IO threads)
    reads: list[tuple[threading.Thread, int]] = []
    real = LocalFileBackend.get_blocks_hashed

    def recorded(self: LocalFileBackend, keys: Any, *args: Any, **kwargs: Any) -> Any:
        reads.append((threading.current_thread(), len(keys)))
        return real(self, keys, *args, **kwargs)

    monkeypatch.setattr(LocalFileBackend, "get_blocks_hashed", recorded)
    consumer = make_rig(url, extra={"io_threads": io_threads})
    run = consumer.prefill("d", tokens, compute=False)
    assert run.num_external == 96 and run.errors == [set(run.block_ids[2:6])]
    consumer.check(tokens, run.block_ids[:2], 32, failed=run.block_ids[2:6])
    if io_threads == 1:
        assert reads == [(threading.current_thread(), 6)]
    else:  # blocks 0-2 at least; those after the bad one may be read ahead
        assert len(reads) >= 3 and {n for _, n in reads} == {1}
        assert threading.current_thread() not in {thread for thread, _ in reads}
