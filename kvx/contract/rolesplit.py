"""`RoleSplitConnector`: a connector written as a scheduler half and a worker half.

The engine builds a connector once per role, and an instance only ever runs one role's methods.
A `RoleSplitConnector[S, W]` subclass names its halves' classes in its type arguments (or in
`scheduler_type` / `worker_type`), each built from the typed extra config, the transfer config
and the engine context, or overrides `build_scheduler` / `build_worker`; the facade builds the
half of its role and forwards every contract method to it, so connector code is two plain classes
(`ConnectorScheduler`, `ConnectorWorker`) with no role checks. A method of the other role fails
with an error that names the method, the role it belongs to and the role the instance was built
for. The facade only delegates: a connector's protocol lives in its halves (the worker half's
`get_handshake_metadata`, the scheduler half's `set_handshake_metadata`, the worker half's
`wait_for_save(metadata)`), never in facade overrides. (Scheduler halves that plan request by
request build on `kvx.contract.planning`.)
"""

from __future__ import annotations

import logging
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, get_args, get_origin

from kvx.contract.auxiliary import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from kvx.contract.base import KVConnectorBase_V1
from kvx.contract.events import KVCacheEvent
from kvx.contract.handshake import KVConnectorHandshakeMetadata, Ranks, split_by_type, with_pp_ranks
from kvx.contract.stats import KVConnectorStats

if TYPE_CHECKING:
    import torch

    from kvx.config.transfer import KVTransferConfig
    from kvx.contract.types import (
        EngineContext,
        ForwardContext,
        KVCacheBlocks,
        Request,
        SchedulerOutput,
    )

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=KVConnectorMetadata)


class ConnectorScheduler(ABC):
    """The scheduler half: the contract's scheduler-side methods, same names, arguments and
    defaults (see `KVConnectorBase_V1`), plus `set_handshake_metadata` (where both of the
    contract's `set_xfer_handshake_metadata*` land) and `shutdown`."""

    handshake_type: ClassVar[type[KVConnectorHandshakeMetadata]] = KVConnectorHandshakeMetadata
    """The kind of handshake metadata this half's workers publish (`kvx.contract.handshake`);
    `set_handshake_metadata` gets only entries of this kind."""

    def on_new_request(self, request: Request) -> None:
        """A request was added to the engine."""

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` the connector can supply, and whether async."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Blocks were allocated for `request`; record what to load."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's work for the workers."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The aggregated worker results of a step arrived."""

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request finished: keep its blocks (True) and the params of its output."""
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV cache events since the last call."""
        return ()

    def reset_cache(self) -> bool | None:
        """Drop cached KV if the connector can (None: not supported)."""
        return None

    def set_handshake_metadata(self, metadata: dict[Ranks, Any]) -> None:
        """Every worker's handshake metadata (a `handshake_type`), keyed by `(pp_rank,
        tp_rank)`, once all registered their KV caches: serve or advertise it to peers.
        Called once, on both P and D; TP-only engines give pp_rank 0."""

    def shutdown(self) -> None:
        """Close threads, sockets and files."""


class ConnectorWorker(ABC, Generic[M]):
    """The worker half: the contract's worker-side methods, given this step's metadata (of
    type `M`, checked by the facade) where they need it. Results are drained by `take_*`."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The KV cache tensors exist (layer name -> tensor)."""

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        """Finish or cancel saves that read the preempted requests' blocks."""

    @abstractmethod
    def start_load_kv(self, metadata: M) -> None:
        """Start this step's loads (before the forward pass)."""

    def loads_at_bind(self) -> bool:
        """Whether this step's loads start when its metadata is bound rather than at
        `start_load_kv` (default False, vLLM's order). vLLM 0.32 calls an async-loading
        connector's `start_load_kv` after launching the forward (`_get_kv_connector_output`
        in `kv_connector_model_runner_mixin.py`), which on a CPU is after it ran: a worker whose
        loads may overlap the forward answers True, so a load can end within the step."""
        return False

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until `layer_name`'s KV is loaded (default: loads are not layer by layer)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, metadata: M) -> None:
        """The layer wrote its KV for this step (default: nothing is saved per layer)."""

    def wait_for_save(self, metadata: M) -> None:
        """The forward pass is over (this step's metadata is still the one given to
        `start_load_kv`): the blocks being saved must be safe to reuse on return."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests done sending, requests done receiving) since the last call."""
        return set(), set()

    def take_load_errors(self) -> set[int]:
        """Block ids whose load failed, since the last call."""
        return set()

    def take_stats(self) -> KVConnectorStats | None:
        """Statistics since the last call, or None."""
        return None

    def take_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Metadata for the scheduler half after this step, or None."""
        return None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """What peers need to connect to this worker (after `register_kv_caches`), a kind
        from `kvx.contract.handshake`, or None; the scheduler half gets every worker's."""
        return None

    def shutdown(self) -> None:
        """Finish or cancel async work; close threads, sockets and files."""


S = TypeVar("S", bound=ConnectorScheduler)
W = TypeVar("W", bound=ConnectorWorker[Any])


@dataclass
class GroupsMetadata(KVConnectorMetadata):
    """One step's metadata of each group's half, in group order (`kvx.split_by_group`'s
    connectors bind it; a `RoleSplitConnector` accepts it beside its own `metadata_type`)."""

    groups: tuple[KVConnectorMetadata, ...] = ()


class RoleSplitConnector(KVConnectorBase_V1, Generic[S, W]):
    """A connector that is a thin facade over a scheduler half (`S`) and a worker half (`W`).

    Subclasses set `extra_config_schema` (the type `self.options` converts the extra config
    to) and, if they have their own, `stats_type`. The classes a subclass gives as `S` and `W`
    are its `scheduler_type` and `worker_type` (each called as `(options, kv_transfer_config,
    engine_context)`; a half built otherwise overrides `build_scheduler` / `build_worker`), and
    the metadata type of `W` (a `ConnectorWorker[M]`) is its `metadata_type` (what
    `build_connector_meta` returns; the worker half gets it checked). Any of the three set in
    the class body wins. Subclasses may still override any contract method, e.g. to reach a
    half through `self.scheduler` / `self.worker`.
    """

    extra_config_schema: ClassVar[type[Any] | None] = None
    scheduler_type: Callable[[Any, KVTransferConfig, EngineContext], S] | None = None
    worker_type: Callable[[Any, KVTransferConfig, EngineContext], W] | None = None
    metadata_type: ClassVar[type[KVConnectorMetadata]] = KVConnectorMetadata
    stats_type: ClassVar[type[KVConnectorStats]] = KVConnectorStats
    _loads_started = False  # this step's loads began at bind (`ConnectorWorker.loads_at_bind`)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Take the halves' classes from `RoleSplitConnector[S, W]` and the metadata type from
        `W`'s `ConnectorWorker[M]`, unless the class body names them."""
        super().__init_subclass__(**kwargs)
        halves = type_arguments(cls, RoleSplitConnector)
        for attribute, half in zip(("scheduler_type", "worker_type"), halves):
            if attribute not in cls.__dict__ and isinstance(half, type):
                setattr(cls, attribute, half)
        worker = cls.worker_type
        if "metadata_type" not in cls.__dict__ and isinstance(worker, type):
            cls.metadata_type = _metadata_type(worker) or cls.metadata_type

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, ctx: EngineContext) -> None:
        super().__init__(config, role, ctx)
        self._scheduler: S | None = None
        self._worker: W | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = self.build_scheduler()
        else:
            self._worker = self.build_worker()

    @property
    def options(self) -> Any:
        """The extra config as `extra_config_schema` (defaults filled in), or the plain dict
        when the connector declares no schema."""
        config, schema = self.kv_transfer_config, self.extra_config_schema
        return (
            config.kv_connector_extra_config if schema is None else config.extra_config_as(schema)
        )

    def build_scheduler(self) -> S:
        """The scheduler half: `scheduler_type(options, kv_transfer_config, engine_context)`."""
        if self.scheduler_type is None:
            raise self._no_half("scheduler")
        return self.scheduler_type(self.options, self.kv_transfer_config, self.engine_context)

    def build_worker(self) -> W:
        """The worker half: `worker_type(options, kv_transfer_config, engine_context)`."""
        if self.worker_type is None:
            raise self._no_half("worker")
        return self.worker_type(self.options, self.kv_transfer_config, self.engine_context)

    def _no_half(self, half: str) -> TypeError:
        return TypeError(
            f"{type(self).__name__} sets no {half}_type and does not override build_{half}: "
            f"name the {half} half's class, or build it in build_{half}"
        )

    @property
    def scheduler(self) -> S:
        """The scheduler half; a worker-role instance has none (the error names the caller)."""
        if self._scheduler is None:
            raise self._wrong_role(KVConnectorRole.SCHEDULER, sys._getframe(1).f_code.co_name)
        return self._scheduler

    @property
    def worker(self) -> W:
        """The worker half; a scheduler-role instance has none (the error names the caller)."""
        if self._worker is None:
            raise self._wrong_role(KVConnectorRole.WORKER, sys._getframe(1).f_code.co_name)
        return self._worker

    def _wrong_role(self, needed: KVConnectorRole, method: str) -> RuntimeError:
        name = type(self).__name__
        return RuntimeError(
            f"{name}.{method} is a {needed.name.lower()}-side method, but this {name} was "
            f"built for the {self.role.name.lower()} role; call it on the connector the engine "
            f"built with KVConnectorRole.{needed.name}"
        )

    def _metadata(self) -> Any:
        """This step's bound metadata, checked to be the connector's `metadata_type`."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, (self.metadata_type, GroupsMetadata)):
            raise TypeError(
                f"{type(self).__name__} expects {self.metadata_type.__name__} as connector "
                f"metadata, got {type(meta).__name__}"
            )
        return meta

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """`kvx.SupportsHMA`'s method, for a subclass that claims it: the scheduler half's own
        (a `kvx.GroupScheduler`), or `request_finished` with an engine's one table."""
        own = getattr(self.scheduler, "request_finished_all_groups", None)
        if own is not None:
            return own(request, block_ids)
        if len(block_ids) != 1:
            raise ValueError(
                f"{type(self).__name__}: {len(block_ids)} KV-cache groups, but its scheduler "
                "half handles one (build it per group: kvx.contract.groups.split_by_group)"
            )
        return self.scheduler.request_finished(request, block_ids[0])

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.scheduler.take_events()

    def reset_cache(self) -> bool | None:
        return self.scheduler.reset_cache()

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self.set_xfer_handshake_metadata_pp_aware(with_pp_ranks(metadata))

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[Ranks, KVConnectorHandshakeMetadata]
    ) -> None:
        """The scheduler half gets the entries of its `handshake_type`; others are another
        connector's (a MultiConnector gives every child the first child's) and are left out."""
        half = self.scheduler
        own, other = split_by_type(metadata, half.handshake_type)
        if other:
            logger.warning(
                "%s: handshake metadata of ranks %s is %s, not %s (another connector's); left out",
                type(self).__name__,
                sorted(other),
                sorted(set(other.values())),
                half.handshake_type.__name__,
            )
        if own:
            half.set_handshake_metadata(own)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        self.worker.handle_preemptions(preempted_req_ids)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._loads_started = self.worker.loads_at_bind()
        if self._loads_started:
            self.worker.start_load_kv(self._metadata())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self._loads_started:
            self.worker.start_load_kv(self._metadata())

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._loads_started = False

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.worker.save_kv_layer(layer_name, kv_layer, self._metadata())

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self.worker.get_finished(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.worker.take_stats()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.take_worker_meta()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker.get_handshake_metadata()

    # ------------------------------------------------------------------ both sides

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return cls.stats_type(dict(data or {}))


def type_arguments(cls: type, generic: type) -> tuple[Any, ...]:
    """The type arguments `cls` gives `generic` among its own bases (`class C(generic[A, B])`),
    or () when it does not subscript it there."""
    for base in cls.__dict__.get("__orig_bases__", ()):
        if get_origin(base) is generic:
            return get_args(base)
    return ()


def _metadata_type(worker: type) -> type[KVConnectorMetadata] | None:
    """`M` of the `ConnectorWorker[M]` that `worker` or one of its bases subclasses."""
    for klass in worker.__mro__:
        args = type_arguments(klass, ConnectorWorker)
        if args and isinstance(args[0], type) and issubclass(args[0], KVConnectorMetadata):
            return args[0]
    return None
