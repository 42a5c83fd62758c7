"""Fixtures for the SharedStorageConnector tests: a real redis-server, storage URLs, and a rig
that drives scheduler-side and worker-side connectors through the contract by hand."""

from __future__ import annotations

import math
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
import torch
from kvx_test_services import RedisProcess

import kvx
from kvx import (
    CachedRequestData,
    EngineContext,
    ForwardContext,
    KVCacheBlocks,
    KVCacheSpec,
    KVConnectorRole,
    KVTransferConfig,
    NewRequestData,
    ParallelInfo,
    Request,
    SchedulerOutput,
)
from kvx.engine.kv_cache import KVHalvesView, token_view
from kvx.layouts import get_layout
from kvx.plugins.storage.metadata import StorageMetadata

LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")
SENTINEL = -1000.0  # what every cache slot holds until something writes it
NAMESPACE = "test-ns"


# -- redis-server ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_port() -> Iterator[int]:
    """The session's shared redis-server."""
    server = RedisProcess()
    try:
        yield server.port
    finally:
        server.kill()


@pytest.fixture
def own_redis() -> Iterator[RedisProcess]:
    """A redis-server of this test's own, which it may kill or freeze."""
    server = RedisProcess()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def redis_url(redis_port: int) -> str:

    client = redis.Redis(port=redis_port)
    client.flushdb()
    client.close()
    return f"redis://127.0.0.1:{redis_port}/0"


@pytest.fixture(params=["file", "memory", "redis"])
def storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """One URL per backend: a directory, an in-memory tree, a real Redis server."""
    if request.param == "file":
        return f"file://{tmp_path}/kv"
    if request.param == "memory":
        return f"memory://kvx-test-{uuid.uuid4().hex}"
    return str(request.getfixturevalue("redis_url"))


# -- the model: KV values a test can predict ---------------------------------------------------


def expected_kv(
    tokens: list[int], layer: int, heads: range, kv_parts: int, head_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """`[tokens, kv_parts, heads, head_size]` of small integers (exact in every float dtype),
    a function of each token, its position, the layer, the global head, K/V and the element."""
    t = torch.tensor(tokens, dtype=torch.long).view(-1, 1, 1, 1)
    pos = torch.arange(len(tokens)).view(-1, 1, 1, 1)
    kv = torch.arange(kv_parts).view(1, -1, 1, 1)
    h = torch.tensor(list(heads)).view(1, 1, -1, 1)
    d = torch.arange(head_size).view(1, 1, 1, -1)
    values = (t * 131 + pos * 7 + layer * 1009 + kv * 17 + h * 37 + d) % 251 - 125
    return values.to(dtype)


def rank_heads(total: int, tp: int, rank: int) -> range:
    if tp <= total:
        return range(rank * total // tp, (rank + 1) * total // tp)
    head = rank * total // tp
    return range(head, head + 1)


# -- the rig -----------------------------------------------------------------------------------


@dataclass
class Prefill:
    """What one request's run through the rig did."""

    num_external: int
    block_ids: list[int]
    errors: list[set[int]] = field(default_factory=list)  # per step
    metas: list[StorageMetadata] = field(default_factory=list)  # per step


class Rig:
    """One engine's connectors: a scheduler side and `tp` worker sides with real KV tensors."""

    LAYERS = LAYERS
    NAMESPACE = NAMESPACE

    def __init__(
        self,
        url: str,
        *,
        tp: int = 1,
        layout: str = "NHD",
        block_size: int = 16,
        heads: int = 4,
        head_size: int = 8,
        num_blocks: int = 24,
        dtype: str = "float32",
        mla: bool = False,
        role: str = "kv_both",
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.config = KVTransferConfig.from_dict(
            {
                "kv_connector": "SharedStorageConnector",
                "kv_role": role,
                "kv_connector_extra_config": {
                    "storage_url": url,
                    "namespace": NAMESPACE,
                    **(extra or {}),
                },
            }
        )
        self.block_size, self.mla, self.heads, self.head_size = block_size, mla, heads, head_size
        self.layout = get_layout("MLA" if mla else layout)
        self.spec = KVCacheSpec(
            LAYERS, heads, head_size, block_size, dtype, layout, mla, num_blocks
        )
        self.dtype = self.spec.torch_dtype
        self.scheduler = kvx.create_connector(
            self.config, KVConnectorRole.SCHEDULER, self.context(tp, 0)
        )
        self.workers: list[tuple[kvx.KVConnectorBase_V1, dict[str, torch.Tensor], range]] = []
        for rank in range(tp):
            worker = kvx.create_connector(
                self.config, KVConnectorRole.WORKER, self.context(tp, rank)
            )
            rank_range = range(1) if mla else rank_heads(heads, tp, rank)
            caches = {
                name: self.layout.allocate(
                    num_blocks, block_size, len(rank_range), head_size, dtype=self.dtype
                ).fill_(SENTINEL)
                for name in LAYERS
            }
            worker.register_kv_caches(caches)
            self.workers.append((worker, caches, rank_range))
        # Hand out block ids in a scrambled order so that block id != position anywhere.
        self.free = [(i * 7) % num_blocks for i in range(num_blocks)]
        self.free.reverse()

    def context(self, tp: int, rank: int) -> EngineContext:
        return EngineContext("engine", "toy-model", self.spec, ParallelInfo(tp, rank))

    @property
    def kv_parts(self) -> int:
        return 1 if self.mla else 2

    def token_view(self, tensor: torch.Tensor) -> torch.Tensor | KVHalvesView:
        """`[blocks, block_size, kv_parts, heads, head_size]` view of a layer's cache."""
        return token_view(self.layout, tensor)

    def allocate(self, num_tokens: int) -> list[int]:
        return [self.free.pop() for _ in range(math.ceil(num_tokens / self.block_size))]

    def prefill(
        self,
        req_id: str,
        tokens: list[int],
        *,
        chunk: int | None = None,
        compute: bool = True,
        num_computed: int = 0,
    ) -> Prefill:
        """Run a prompt: match, allocate, then steps of `chunk` tokens (all at once by default).
        With `compute=False` the forward writes nothing, so the cache shows only what loaded."""
        request = Request(req_id, list(tokens))
        self.scheduler.on_new_request(request)
        n_ext, is_async = self.scheduler.get_num_new_matched_tokens(request, num_computed)
        assert n_ext is not None and not is_async
        blocks = self.allocate(len(tokens))
        self.scheduler.update_state_after_alloc(
            request, KVCacheBlocks((blocks,), (num_computed // self.block_size,)), n_ext
        )
        run = Prefill(n_ext, blocks)
        computed = num_computed + n_ext
        first = True
        while computed < len(tokens):
            n = min(chunk or len(tokens), len(tokens) - computed)
            out = SchedulerOutput(num_scheduled_tokens={req_id: n})
            if first:
                out.scheduled_new_reqs.append(
                    NewRequestData(req_id, list(tokens), (blocks,), computed)
                )
            else:
                out.scheduled_cached_reqs = CachedRequestData(
                    req_ids=[req_id],
                    new_token_ids=[[]],
                    all_token_ids={req_id: list(tokens)},
                    new_block_ids=[None],
                    num_computed_tokens=[computed],
                )
            writes = {req_id: (tokens, blocks, computed, computed + n)} if compute else {}
            errors, meta = self.step(out, writes)
            run.errors.append(errors)
            run.metas.append(meta)
            computed += n
            first = False
        self.scheduler.request_finished(request, blocks)
        return run

    def step(
        self, out: SchedulerOutput, writes: dict[str, tuple[list[int], list[int], int, int]]
    ) -> tuple[set[int], StorageMetadata]:
        """One engine step: metadata (sent through msgpack, as between processes), then every
        worker loads, "computes" `writes` layer by layer, saves, and reports load errors."""
        meta = self.scheduler.build_connector_meta(out)
        assert isinstance(meta, StorageMetadata)
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=StorageMetadata)
        errors: set[int] = set()
        for worker, caches, heads in self.workers:
            worker.bind_connector_metadata(wire)
            worker.start_load_kv(ForwardContext(kv_caches=caches))
            for index, name in enumerate(LAYERS):
                worker.wait_for_layer_load(name)
                view = self.token_view(caches[name])
                for tokens, blocks, start, end in writes.values():
                    kv = expected_kv(
                        tokens[:end], index, heads, self.kv_parts, self.head_size, self.dtype
                    )
                    for pos in range(start, end):
                        view[blocks[pos // self.block_size], pos % self.block_size] = kv[pos]
                worker.save_kv_layer(name, caches[name], None)
            worker.wait_for_save()
            errors |= worker.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
        return errors, meta

    def check(
        self,
        tokens: list[int],
        blocks: list[int],
        num_tokens: int,
        *,
        alone: bool = True,
        failed: Sequence[int] = (),
    ) -> None:
        """The first `num_tokens` of the request hold exactly the model's KV on every worker
        and layer, and (if the request ran `alone`) every other slot still holds the sentinel,
        except in the `failed` blocks: blocks reported as load errors hold whatever was read
        into them (the engine recomputes them; loads go straight into the blocks)."""
        for _, caches, heads in self.workers:
            for index, name in enumerate(LAYERS):
                view = self.token_view(caches[name])
                want = expected_kv(
                    tokens[:num_tokens], index, heads, self.kv_parts, self.head_size, self.dtype
                )
                touched = torch.zeros(view.shape[:2], dtype=torch.bool)
                for pos in range(num_tokens):
                    b, o = blocks[pos // self.block_size], pos % self.block_size
                    assert torch.equal(view[b, o], want[pos]), (name, heads, pos)
                    touched[b, o] = True
                for b in failed:
                    touched[b] = True
                if alone:
                    untouched = view[~touched]
                    assert bool((untouched == SENTINEL).all()), f"{name}: other slots changed"

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        for worker, _, _ in self.workers:
            worker.shutdown()


@pytest.fixture
def make_rig() -> Iterator[Callable[..., Rig]]:
    """Build rigs; every one is shut down after the test."""
    rigs: list[Rig] = []

    def make(url: str, **kwargs: Any) -> Rig:
        rig = Rig(url, **kwargs)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.shutdown()


@pytest.fixture
def no_new_threads() -> Iterator[None]:
    """Fail if the test leaves a thread running."""
    before = set(threading.enumerate())
    yield
    left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not left, f"threads left running: {left}"
