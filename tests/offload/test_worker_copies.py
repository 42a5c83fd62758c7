"""OffloadingConnector worker: where its block copies run and how a step's stores are batched.

A copy of at most `inline_copy_bytes` runs on the calling thread when the copy thread is idle;
otherwise (a larger copy, or jobs still queued, which must run first) on the copy thread. A
step's stores go to one block copy; a store that fails is retried alone so only it is reported
failed. Every element of the engine caches and of the CPU tier is compared after each copy,
the blocks and slots that must not change included.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any
from unittest.mock import patch

import pytest
import torch

import kvx
from kvx import EngineContext, KVCacheSpec, KVConnectorRole, KVTransferConfig, ParallelInfo
from kvx.layouts import NHD
from kvx.plugins.offload import worker as worker_module
from kvx.plugins.offload.metadata import LoadSpec, OffloadMetadata, OffloadWorkerMeta, StoreSpec
from kvx.plugins.offload.worker import OffloadWorker, by_source

LAYERS = [f"model.layers.{i}.self_attn" for i in range(4)]
BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 16, 4, 2, 8
CHUNK_BYTES = len(LAYERS) * 2 * BLOCK_SIZE * HEADS * HEAD_SIZE * 2  # bf16, K and V
SLOTS = 8


def random_bf16(shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.bfloat16)
    t.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, shape, generator=gen))
    return t


@pytest.fixture
def make_worker() -> Iterator[Any]:
    built: list[Any] = []

    def make(**extra: object) -> tuple[OffloadWorker, dict[str, torch.Tensor]]:
        config = KVTransferConfig.from_dict(
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": SLOTS * CHUNK_BYTES, **extra},
            }
        )
        spec = KVCacheSpec(
            tuple(LAYERS), HEADS, HEAD_SIZE, BLOCK_SIZE, "bfloat16", "NHD", False, BLOCKS
        )
        connector = kvx.create_connector(
            config, KVConnectorRole.WORKER, EngineContext("t", "m", spec, ParallelInfo(1, 0))
        )
        built.append(connector)
        gen = torch.Generator().manual_seed(3)
        shape = NHD.allocate(BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, dtype=torch.bfloat16).shape
        caches = {name: random_bf16(shape, gen) for name in LAYERS}
        connector.register_kv_caches(caches)
        worker = connector.worker
        assert isinstance(worker, OffloadWorker) and worker.num_slots == SLOTS
        for t in worker.cpu.values():  # slots that must not change hold known bytes too
            t.copy_(random_bf16(t.shape, gen))
        return worker, caches

    yield make
    for connector in built:
        connector.shutdown()


def threads_of(worker: OffloadWorker) -> list[int]:
    """Record the thread of each of `worker`'s copies (the copies themselves run unchanged)."""
    seen: list[int] = []

    def recording(real: Any) -> Any:
        def copy(src: list[int], dst: list[int]) -> None:
            seen.append(threading.get_ident())
            real(src, dst)

        return copy

    for attr in ("_to_cpu", "_from_cpu"):  # one copier per KV-cache group (one group here)
        setattr(worker, attr, [recording(real) for real in getattr(worker, attr)])
    return seen


def step(worker: OffloadWorker, meta: OffloadMetadata) -> None:
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)


def expect_copied(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], moves: dict[int, torch.Tensor]
) -> None:
    """Every element of `after` equals `before`, except blocks `moves` (dim 1) which hold the
    given per-layer bytes (`moves[i]` stacked over layers)."""
    for n, name in enumerate(LAYERS):
        want = before[name].clone()
        for block, data in moves.items():
            want[:, block] = data[n]
        assert torch.equal(after[name].view(torch.int16), want.view(torch.int16)), name


def blocks(caches: dict[str, torch.Tensor], block: int) -> torch.Tensor:
    return torch.stack([caches[name][:, block] for name in LAYERS])


def test_small_copies_run_on_the_calling_thread_when_idle(make_worker: Any) -> None:
    worker, caches = make_worker()
    seen = threads_of(worker)
    gpu_before = {n: t.clone() for n, t in caches.items()}
    cpu_before = {n: t.clone() for n, t in worker.cpu.items()}
    step(worker, OffloadMetadata(stores=[StoreSpec("a", ["k3", "k7"], [5, 1], [3, 7])]))
    ((future, _),) = worker._stores["a"]
    assert future.done() and seen == [threading.get_ident()]  # done before anything waited
    expect_copied(cpu_before, worker.cpu, {5: blocks(caches, 3), 1: blocks(caches, 7)})
    step(worker, OffloadMetadata(loads=[LoadSpec("b", [12, 0], [1, 5], [0, 0])]))
    assert worker._loads["b"].done() and seen == [threading.get_ident()] * 2
    expect_copied(gpu_before, caches, {12: blocks(gpu_before, 7), 0: blocks(gpu_before, 3)})
    assert worker.get_finished(set()) == (set(), {"b"})


def test_inline_copies_that_succeed_build_no_future(make_worker: Any) -> None:
    """A successful inline store or load is reported through one shared done future (a new
    Future's lock and condition are a third of a small step's cost once the forward evicted
    them from the caches); the bytes and what get_finished reports are unchanged."""
    worker, caches = make_worker()
    gpu_before = {n: t.clone() for n, t in caches.items()}
    cpu_before = {n: t.clone() for n, t in worker.cpu.items()}

    def no_future() -> None:
        raise AssertionError("an inline copy built a Future")

    with patch.object(worker_module, "Future", no_future):
        step(worker, OffloadMetadata(stores=[StoreSpec("a", ["k3", "k7"], [5, 1], [3, 7])]))
        step(worker, OffloadMetadata(loads=[LoadSpec("b", [12, 0], [1, 5], [0, 0])]))
        assert worker.get_finished(set()) == (set(), {"b"})
    expect_copied(cpu_before, worker.cpu, {5: blocks(caches, 3), 1: blocks(caches, 7)})
    expect_copied(gpu_before, caches, {12: blocks(gpu_before, 7), 0: blocks(gpu_before, 3)})
    meta = worker.take_worker_meta()
    assert isinstance(meta, OffloadWorkerMeta)
    assert meta.stored == {"k3": 1, "k7": 1} and meta.failed == {}


@pytest.mark.parametrize("case", ["inline_copy_bytes 0", "bigger than inline_copy_bytes"])
def test_copies_go_to_the_copy_thread_when_configured_or_large(make_worker: Any, case: str) -> None:
    limit = 0 if case == "inline_copy_bytes 0" else CHUNK_BYTES  # the store moves 2 chunks
    worker, caches = make_worker(inline_copy_bytes=limit)
    seen = threads_of(worker)
    cpu_before = {n: t.clone() for n, t in worker.cpu.items()}
    step(worker, OffloadMetadata(stores=[StoreSpec("a", ["k3", "k7"], [5, 1], [3, 7])]))
    worker.handle_preemptions(set())  # waits for the queued store
    assert len(seen) == 1 and seen[0] != threading.get_ident()
    expect_copied(cpu_before, worker.cpu, {5: blocks(caches, 3), 1: blocks(caches, 7)})


def test_a_busy_copy_thread_keeps_the_order(make_worker: Any) -> None:
    """With a job still queued, even a small store waits behind it on the copy thread."""
    worker, caches = make_worker()
    seen = threads_of(worker)
    cpu_before = {n: t.clone() for n, t in worker.cpu.items()}
    gate = threading.Event()
    worker._submit(gate.wait, 30)
    step(worker, OffloadMetadata(stores=[StoreSpec("a", ["k2"], [0], [2])]))
    ((future, _),) = worker._stores["a"]
    assert not future.done() and seen == []
    expect_copied(cpu_before, worker.cpu, {})  # nothing copied yet
    gate.set()
    worker.handle_preemptions(set())
    assert len(seen) == 1 and seen[0] != threading.get_ident()
    expect_copied(cpu_before, worker.cpu, {0: blocks(caches, 2)})


def test_a_step_s_stores_share_one_copy_and_fail_alone(make_worker: Any) -> None:
    worker, caches = make_worker()
    seen = threads_of(worker)
    cpu_before = {n: t.clone() for n, t in worker.cpu.items()}
    stores = [StoreSpec("a", ["k1", "k2"], [2, 3], [1, 2]), StoreSpec("b", ["k4"], [4], [4])]
    step(worker, OffloadMetadata(stores=stores))
    assert len(seen) == 1  # one block copy for both requests
    moved = {2: blocks(caches, 1), 3: blocks(caches, 2), 4: blocks(caches, 4)}
    expect_copied(cpu_before, worker.cpu, moved)
    worker.get_finished(set())
    meta = worker.take_worker_meta()
    assert isinstance(meta, OffloadWorkerMeta)
    assert meta.stored == {"k1": 1, "k2": 1, "k4": 1} and meta.failed == {}
    # Block 99 does not exist: the batch fails, then "c" alone fails and "d" is stored.
    bad = [StoreSpec("c", ["k9"], [6], [99]), StoreSpec("d", ["k5"], [7], [5])]
    step(worker, OffloadMetadata(stores=bad))
    worker.get_finished(set())
    meta = worker.take_worker_meta()
    assert isinstance(meta, OffloadWorkerMeta)
    assert meta.stored == {"k5": 1} and meta.failed == {"k9": 1}
    expect_copied(cpu_before, worker.cpu, {**moved, 7: blocks(caches, 5)})


def test_pairs_are_copied_in_source_order() -> None:
    assert by_source([9, 2, 5, 2], [0, 1, 2, 3]) == ([2, 2, 5, 9], [1, 3, 2, 0])
    assert by_source([], []) == ([], [])
