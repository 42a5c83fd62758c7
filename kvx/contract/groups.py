"""One connector half per KV-cache group: how a `RoleSplitConnector` handles vLLM's hybrid
allocator (`kvx.SupportsHMA`) without knowing about groups.

With several groups (e.g. Gemma-3: sliding-window layers and full-attention layers) each group
has its own block table per request. `group_contexts` gives each group an `EngineContext` of
its layers only; a `GroupScheduler` runs one scheduler half per group, each seeing only its
group's tables (a one-group `SchedulerOutput` / `KVCacheBlocks`), and a `GroupWorker` one
worker half per group, each with its group's caches and its part of the step's
`GroupsMetadata`. A sliding-window group's table then starts with `NULL_BLOCK` entries, which
the half already skips (as with one sliding-window group).

Only synchronous halves compose: a half that loads asynchronously or holds blocks after a
request finishes would need the groups' completions counted together, which this does not do
(it raises instead of reporting a request done early).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kvx.contract.auxiliary import KVConnectorMetadata, KVConnectorOutput, KVConnectorWorkerMetadata
from kvx.contract.events import KVCacheEvent
from kvx.contract.rolesplit import ConnectorScheduler, ConnectorWorker, GroupsMetadata
from kvx.contract.stats import KVConnectorStats
from kvx.contract.types import CachedRequestData, KVCacheBlocks

if TYPE_CHECKING:
    import torch

    from kvx.contract.types import EngineContext, Request, SchedulerOutput


@dataclass
class GroupsWorkerMetadata(KVConnectorWorkerMetadata):
    """Each group's worker metadata (None where a group's half has none), in group order."""

    groups: tuple[KVConnectorWorkerMetadata | None, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, GroupsWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into GroupsWorkerMetadata")
        self.groups = tuple(
            theirs if mine is None else mine if theirs is None else mine.aggregate(theirs)
            for mine, theirs in zip(self.groups, other.groups, strict=True)
        )
        return self


def group_contexts(ctx: EngineContext) -> list[EngineContext]:
    """Per KV-cache group, the context of an engine with only that group's layers."""
    spec = ctx.cache
    groups = spec.layer_groups or (0,) * spec.num_layers
    return [
        replace(
            ctx,
            cache=replace(
                spec,
                layer_names=tuple(
                    n for n, g in zip(spec.layer_names, groups, strict=True) if g == i
                ),
                layer_groups=(),
            ),
            enable_hma=False,
        )
        for i in range(spec.num_groups)
    ]


def one_group_output(out: SchedulerOutput, group: int) -> SchedulerOutput:
    """`out` with only `group`'s block tables (as group 0)."""
    cached = out.scheduled_cached_reqs
    return replace(
        out,
        scheduled_new_reqs=[
            replace(new, block_ids=(list(new.block_ids[group]),)) for new in out.scheduled_new_reqs
        ],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=cached.req_ids,
            resumed_req_ids=cached.resumed_req_ids,
            new_token_ids=cached.new_token_ids,
            all_token_ids=cached.all_token_ids,
            new_block_ids=[None if b is None else (list(b[group]),) for b in cached.new_block_ids],
            num_computed_tokens=cached.num_computed_tokens,
        ),
    )


class GroupScheduler(ConnectorScheduler):
    """One scheduler half per KV-cache group; an external hit is the shortest of the groups'."""

    def __init__(self, halves: Sequence[ConnectorScheduler]) -> None:
        self.halves = list(halves)

    def on_new_request(self, request: Request) -> None:
        for half in self.halves:
            half.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        answers = [h.get_num_new_matched_tokens(request, num_computed_tokens) for h in self.halves]
        counts = [count for count, _ in answers]
        if any(count is None for count in counts):
            return None, False  # a group cannot tell yet: ask again next step
        hit = min(count for count in counts if count is not None)
        if hit and any(is_async for _, is_async in answers):
            raise RuntimeError(
                "kvx GroupScheduler: a group's half answered an asynchronous load; "
                "per-group halves must load synchronously"
            )
        return hit, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        hashed = blocks.num_hashed_blocks
        for g, half in enumerate(self.halves):
            one = KVCacheBlocks(
                (list(blocks.block_ids[g]),), None if hashed is None else (hashed[g],)
            )
            half.update_state_after_alloc(request, one, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> GroupsMetadata:
        return GroupsMetadata(
            tuple(
                half.build_connector_meta(one_group_output(scheduler_output, g))
                for g, half in enumerate(self.halves)
            )
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        for g, half in enumerate(self.halves):
            own = meta.groups[g] if isinstance(meta, GroupsWorkerMetadata) else meta
            half.update_connector_output(replace(connector_output, kv_connector_worker_meta=own))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if len(self.halves) != 1:
            raise ValueError(
                f"request_finished got one block table; this engine has {len(self.halves)} "
                "KV-cache groups (request_finished_all_groups gives one per group)"
            )
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if len(block_ids) != len(self.halves):
            raise ValueError(
                f"block_ids: {len(block_ids)} tables for {len(self.halves)} KV-cache groups"
            )
        params: dict[str, Any] | None = None
        for half, table in zip(self.halves, block_ids, strict=True):
            delay, own = half.request_finished(request, table)
            if delay:
                raise RuntimeError(
                    "kvx GroupScheduler: a group's half holds blocks after the request "
                    "finished; per-group halves must not"
                )
            params = params if own is None else {**(params or {}), **own}
        return False, params

    def take_events(self) -> Iterable[KVCacheEvent]:
        return [event for half in self.halves for event in half.take_events()]

    def reset_cache(self) -> bool | None:
        answers = [half.reset_cache() for half in self.halves]
        return None if None in answers else all(answers)

    def shutdown(self) -> None:
        for half in self.halves:
            half.shutdown()


class GroupWorker(ConnectorWorker[GroupsMetadata]):
    """One worker half per KV-cache group, each given its group's layers and metadata."""

    def __init__(self, halves: Sequence[ConnectorWorker[Any]], contexts: Sequence[EngineContext]):
        self.halves = list(halves)
        self.group_of = {
            name: g for g, ctx in enumerate(contexts) for name in ctx.cache.layer_names
        }

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        unknown = sorted(set(kv_caches) - set(self.group_of))
        if unknown:
            raise ValueError(f"KV cache layers {unknown} are in no KV-cache group of the context")
        for g, half in enumerate(self.halves):
            half.register_kv_caches(
                {name: t for name, t in kv_caches.items() if self.group_of[name] == g}
            )

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        for half in self.halves:
            half.handle_preemptions(preempted_req_ids)

    def start_load_kv(self, metadata: GroupsMetadata) -> None:
        for half, meta in zip(self.halves, self._split(metadata), strict=True):
            half.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.halves[self.group_of[layer_name]].wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, metadata: GroupsMetadata
    ) -> None:
        g = self.group_of[layer_name]
        self.halves[g].save_kv_layer(layer_name, kv_layer, self._split(metadata)[g])

    def wait_for_save(self, metadata: GroupsMetadata) -> None:
        for half, meta in zip(self.halves, self._split(metadata), strict=True):
            half.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        for half in self.halves:
            sending, recving = half.get_finished(finished_req_ids)
            if sending or recving:
                raise RuntimeError(
                    "kvx GroupWorker: a group's half finished an asynchronous transfer; "
                    "per-group halves must be synchronous"
                )
        return set(), set()

    def take_load_errors(self) -> set[int]:
        # block ids come from one pool shared by every group: the union names each once
        return {b for half in self.halves for b in half.take_load_errors()}

    def take_stats(self) -> KVConnectorStats | None:
        total: KVConnectorStats | None = None
        for half in self.halves:
            stats = half.take_stats()
            if stats is not None:
                total = stats if total is None else total.aggregate(stats)
        return total

    def take_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        metas = tuple(half.take_worker_meta() for half in self.halves)
        return None if all(m is None for m in metas) else GroupsWorkerMetadata(metas)

    def shutdown(self) -> None:
        for half in self.halves:
            half.shutdown()

    def _split(self, metadata: GroupsMetadata) -> tuple[KVConnectorMetadata, ...]:
        if len(metadata.groups) != len(self.halves):
            raise ValueError(
                f"GroupsMetadata has {len(metadata.groups)} groups, the worker {len(self.halves)}"
            )
        return metadata.groups


def split_by_group(
    ctx: EngineContext,
    build: Callable[[EngineContext], Any],
    composite: Callable[[list[Any], list[EngineContext]], Any],
) -> Any:
    """`build(ctx)` for a one-group engine; otherwise `composite` of `build` per group's
    context (e.g. `lambda halves, _: GroupScheduler(halves)`)."""
    if ctx.cache.num_groups == 1:
        return build(ctx)
    contexts = group_contexts(ctx)
    return composite([build(c) for c in contexts], contexts)
