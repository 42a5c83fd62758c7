"""RoleSplitConnector: one half per role, every contract method forwarded to its half, and a
clear error for a method of the other role."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kvx import (
    ConnectorScheduler,
    ConnectorWorker,
    EngineContext,
    KVCacheSpec,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorStats,
    KVTransferConfig,
    RoleSplitConnector,
)

CTX = EngineContext(
    engine_id="e",
    model_name="m",
    cache=KVCacheSpec(
        layer_names=("l0",), num_kv_heads=1, head_size=8, block_size=16, dtype="bfloat16"
    ),
)
CONFIG = KVTransferConfig(kv_connector="Halves", kv_role="kv_both")


@dataclass
class Meta(KVConnectorMetadata):
    step: int


class Sched(ConnectorScheduler):
    def __init__(self) -> None:
        self.steps = 0

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return 7, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> Meta:
        self.steps += 1
        return Meta(self.steps)


class Work(ConnectorWorker[Meta]):
    def __init__(self) -> None:
        self.loaded: list[int] = []
        self.saved: list[tuple[str, int]] = []
        self.closed = False

    def start_load_kv(self, metadata: Meta) -> None:
        self.loaded.append(metadata.step)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, metadata: Meta) -> None:
        self.saved.append((layer_name, metadata.step))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(), {"r"}

    def take_stats(self) -> KVConnectorStats | None:
        return KVConnectorStats({"n": 1})

    def shutdown(self) -> None:
        self.closed = True


class Halves(RoleSplitConnector[Sched, Work]):
    metadata_type = Meta

    def build_scheduler(self) -> Sched:
        return Sched()

    def build_worker(self) -> Work:
        return Work()


def test_each_role_builds_only_its_half_and_forwards_to_it() -> None:
    sched = Halves(CONFIG, KVConnectorRole.SCHEDULER, CTX)
    assert sched.get_num_new_matched_tokens(object(), 0) == (7, True)
    meta = sched.build_connector_meta(object())  # type: ignore[arg-type]
    assert sched.request_finished(object(), [1]) == (False, None)  # type: ignore[arg-type]
    worker = Halves(CONFIG, KVConnectorRole.WORKER, CTX)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(object())  # type: ignore[arg-type]
    worker.save_kv_layer("l0", object(), None)  # type: ignore[arg-type]
    assert worker.worker.loaded == [1] and worker.worker.saved == [("l0", 1)]
    assert worker.get_finished(set()) == (None, {"r"})  # empty sets become None
    assert worker.get_block_ids_with_load_errors() == set()
    stats = worker.get_kv_connector_stats()
    assert stats is not None and stats.data == {"n": 1}
    worker.shutdown()
    assert worker.worker.closed
    rebuilt = Halves.build_kv_connector_stats({"n": 2})
    assert type(rebuilt) is KVConnectorStats and rebuilt.data == {"n": 2}


def test_a_method_of_the_other_role_names_itself_and_both_roles() -> None:
    worker = Halves(CONFIG, KVConnectorRole.WORKER, CTX)
    with pytest.raises(RuntimeError) as info:
        worker.get_num_new_matched_tokens(object(), 0)  # type: ignore[arg-type]
    message = str(info.value)
    assert "Halves.get_num_new_matched_tokens is a scheduler-side method" in message
    assert "built for the worker role" in message
    sched = Halves(CONFIG, KVConnectorRole.SCHEDULER, CTX)
    with pytest.raises(
        RuntimeError,
        match=r"Halves.wait_for_save is a worker-side method.*"
        r"built for the scheduler role",
    ):
        sched.wait_for_save()


def test_metadata_of_another_type_is_refused_with_both_names() -> None:
    worker = Halves(CONFIG, KVConnectorRole.WORKER, CTX)
    worker.bind_connector_metadata(KVConnectorMetadata())
    with pytest.raises(
        TypeError, match="Halves expects Meta as connector metadata, got KVConnectorMetadata"
    ):
        worker.start_load_kv(object())  # type: ignore[arg-type]


@dataclass
class HalvesOptions:
    depth: int = 3


class NamedSched(Sched):
    def __init__(self, options: HalvesOptions, config: KVTransferConfig, ctx: Any) -> None:
        super().__init__()
        self.made_from = (options, config, ctx)


class NamedWork(Work):
    def __init__(self, options: HalvesOptions, config: KVTransferConfig, ctx: Any) -> None:
        super().__init__()
        self.made_from = (options, config, ctx)


class Named(RoleSplitConnector[NamedSched, NamedWork]):
    extra_config_schema = HalvesOptions
    scheduler_type = NamedSched
    worker_type = NamedWork
    metadata_type = Meta


def test_halves_named_by_class_attributes_are_built_from_the_typed_options() -> None:
    config = KVTransferConfig(
        kv_connector="Named", kv_role="kv_both", kv_connector_extra_config={"depth": 5}
    )
    sched = Named(config, KVConnectorRole.SCHEDULER, CTX)
    worker = Named(config, KVConnectorRole.WORKER, CTX)
    for made_from in (sched.scheduler.made_from, worker.worker.made_from):
        assert made_from == (HalvesOptions(depth=5), config, CTX)


class Derived(RoleSplitConnector[NamedSched, NamedWork]):
    extra_config_schema = HalvesOptions


def test_halves_and_metadata_type_come_from_the_type_arguments() -> None:
    assert Derived.scheduler_type is NamedSched and Derived.worker_type is NamedWork
    assert Derived.metadata_type is Meta  # NamedWork is a ConnectorWorker[Meta]
    sched = Derived(CONFIG, KVConnectorRole.SCHEDULER, CTX)
    worker = Derived(CONFIG, KVConnectorRole.WORKER, CTX)
    assert isinstance(sched.scheduler, NamedSched) and isinstance(worker.worker, NamedWork)
    worker.bind_connector_metadata(sched.build_connector_meta(object()))  # type: ignore[arg-type]
    worker.start_load_kv(object())  # type: ignore[arg-type]
    assert worker.worker.loaded == [1]
    worker.bind_connector_metadata(KVConnectorMetadata())
    with pytest.raises(TypeError, match="Derived expects Meta as connector metadata"):
        worker.start_load_kv(object())  # type: ignore[arg-type]

    class Overridden(Derived):
        worker_type = Work  # named in the body: wins over the type argument

    assert Overridden.scheduler_type is NamedSched and Overridden.worker_type is Work


def test_a_connector_that_names_no_half_says_what_to_do() -> None:
    class Nameless(RoleSplitConnector):  # type: ignore[type-arg]  # no type arguments either
        pass

    with pytest.raises(TypeError, match="Nameless sets no worker_type and does not override"):
        Nameless(CONFIG, KVConnectorRole.WORKER, CTX)
