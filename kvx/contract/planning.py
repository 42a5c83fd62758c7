"""Scheduler halves that plan each step request by request (storage, LMCache, offloading).

`RequestTracker` is the bookkeeping most scheduler halves repeat: each scheduled request's block
table, kept from each step's `SchedulerOutput`, and the loads `update_state_after_alloc`
recorded for the step. `PlanningScheduler` builds the step's metadata from it, one request at a
time; `LoadsAndStores` is the metadata most such connectors send: what each worker loads into
the engine's blocks and what it stores from them.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kvx.contract.auxiliary import KVConnectorMetadata
from kvx.contract.rolesplit import ConnectorScheduler, type_arguments

if TYPE_CHECKING:
    from kvx.contract.types import KVCacheBlocks, NewRequestData, Request, SchedulerOutput

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=KVConnectorMetadata)
R = TypeVar("R")
L = TypeVar("L")
S = TypeVar("S")


@dataclass
class LoadsAndStores(KVConnectorMetadata, Generic[L, S]):
    """A step's work for the workers as a planning connector sends it: the loads (`L`, each
    into a request's engine blocks) and the stores (`S`, each from them)."""

    loads: list[L] = field(default_factory=list)
    stores: list[S] = field(default_factory=list)


@dataclass
class TrackedRequest(Generic[R]):
    """A request a `RequestTracker` follows: its block table (engine block ids of the first KV
    cache group, the whole table) and the connector's own `state` for it."""

    req_id: str
    block_ids: list[int]
    state: R


@dataclass(frozen=True)
class ScheduledRequest(Generic[R]):
    """One request of a step's `SchedulerOutput`, its block table brought up to date."""

    request: TrackedRequest[R]
    num_computed_tokens: int  # before this step's tokens (loaded ones included)
    num_scheduled_tokens: int
    num_external_tokens: int  # to load this step, as `update_state_after_alloc` recorded
    resumed: bool  # back from preemption, with a whole new block table

    @property
    def req_id(self) -> str:
        return self.request.req_id

    @property
    def block_ids(self) -> list[int]:
        return self.request.block_ids

    @property
    def state(self) -> R:
        return self.request.state


class RequestTracker(Generic[R]):
    """Each scheduled request's block table, as vLLM's scheduler reports it, and this step's
    loads, for a scheduler half that plans its loads and stores in `build_connector_meta`.

    New and resumed requests carry their whole table, running ones this step's new blocks, and
    a preempted request has none until it resumes. A request is followed from `track` (e.g. in
    `update_state_after_alloc`), or from its first scheduling, when `start` makes its state
    from the `NewRequestData` (no `start`, or None from it: not followed). `forget` it when it
    finishes.
    """

    def __init__(
        self, owner: str, start: Callable[[NewRequestData], R | None] | None = None
    ) -> None:
        self.owner = owner  # names the connector in log messages
        self._start = start
        self.requests: dict[str, TrackedRequest[R]] = {}
        self._loads: dict[str, int] = {}  # this step: request id -> external tokens

    def track(self, req_id: str, block_ids: list[int], state: R) -> TrackedRequest[R]:
        """Follow `req_id` from now on, with this block table and state."""
        tracked = self.requests[req_id] = TrackedRequest(req_id, list(block_ids), state)
        return tracked

    def record_load(self, req_id: str, num_external_tokens: int) -> None:
        """`update_state_after_alloc`: load `num_external_tokens` (0: none) in this step."""
        if num_external_tokens > 0:
            self._loads[req_id] = num_external_tokens
        else:
            self._loads.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self._loads.pop(req_id, None)

    def scheduled(self, out: SchedulerOutput) -> list[ScheduledRequest[R]]:
        """This step's followed requests, in the output's order, block tables brought up to
        date; the step's recorded loads are handed out here (loads recorded for requests not
        scheduled in the step are dropped, with a warning)."""
        for req_id in out.preempted_req_ids:
            if req_id in self.requests:
                self.requests[req_id].block_ids = []
        steps = []
        for new in out.scheduled_new_reqs:
            tracked = self.requests.get(new.req_id)
            if tracked is None:
                state = None if self._start is None else self._start(new)
                if state is None:
                    continue
                tracked = self.track(new.req_id, [], state)
            tracked.block_ids = list(new.block_ids[0])
            steps.append(self._step(tracked, new.num_computed_tokens, out, False))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self.requests.get(req_id)
            if tracked is None:
                continue
            added = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if resumed:
                tracked.block_ids = list(added[0]) if added else []
            elif added:
                tracked.block_ids.extend(added[0])
            steps.append(self._step(tracked, cached.num_computed_tokens[i], out, resumed))
        if self._loads:
            logger.warning("%s: loads of unscheduled requests dropped: %s", self.owner, self._loads)
            self._loads.clear()
        return steps

    def _step(
        self, tracked: TrackedRequest[R], computed: int, out: SchedulerOutput, resumed: bool
    ) -> ScheduledRequest[R]:
        scheduled = out.num_scheduled_tokens.get(tracked.req_id, 0)
        load = self._loads.pop(tracked.req_id, 0)
        return ScheduledRequest(tracked, computed, scheduled, load, resumed)


class PlanningScheduler(ConnectorScheduler, Generic[R, M]):
    """A scheduler half that plans each step request by request when the step's metadata is
    built (storage, LMCache): `update_state_after_alloc` records the step's load in
    `self.requests` (a `RequestTracker` the subclass makes), and `build_connector_meta` calls
    `plan` for each scheduled request, then `step_planned`, on a fresh `metadata_type()` (the
    `M` a subclass gives, unless its class body sets `metadata_type`)."""

    metadata_type: type[M]
    requests: RequestTracker[R]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        metadata = type_arguments(cls, PlanningScheduler)[1:]
        if "metadata_type" not in cls.__dict__ and metadata and isinstance(metadata[0], type):
            cls.metadata_type = metadata[0]

    @abstractmethod
    def plan(self, meta: M, step: ScheduledRequest[R]) -> None:
        """Add `step`'s loads and stores to this step's `meta`."""

    def step_planned(self) -> None:
        """Every scheduled request was planned (e.g. drop what was learned for this step)."""

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.requests.record_load(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> M:
        meta = self.metadata_type()
        for step in self.requests.scheduled(scheduler_output):
            self.plan(meta, step)
        self.step_planned()
        return meta
