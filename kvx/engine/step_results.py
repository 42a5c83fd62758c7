"""What the reference scheduler does with a step's results: sampled tokens appended, transfers
the connector reported applied (held blocks released, loads received), load errors handled by
`kv_load_failure_policy`, requests finished (`request_finished` asked, blocks held or freed),
and the contract violations seen on the way recorded.

`StepResults` is the half of `kvx.engine.scheduler.Scheduler` that runs after the forward pass;
the scheduler itself decides what each step computes, loads and frees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from kvx.contract.auxiliary import KVConnectorOutput, SupportsHMA
from kvx.contract.base import KVConnectorBase_V1
from kvx.contract.types import RequestStatus, SchedulerOutput
from kvx.engine.block_pool import BlockPool, block_hashes
from kvx.engine.finished_ids import unheld_finished_ids
from kvx.engine.kv_groups import WindowGroups
from kvx.engine.load_errors import failed_loads, stray_load_errors
from kvx.engine.request_state import RequestState


class ResultPolicies(Protocol):
    """The scheduler config's fields applying results reads."""

    @property
    def block_size(self) -> int: ...
    @property
    def kv_load_failure_policy(self) -> str: ...
    @property
    def kv_role(self) -> str | None: ...


@dataclass
class RequestOutput:
    """What a step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    output_token_ids: list[int]
    finished: bool
    status: RequestStatus
    kv_transfer_params: dict[str, Any] | None = None


class StepResults:
    """Applies each step's results to the scheduler's requests (mixed into `Scheduler`, which
    sets these attributes)."""

    config: ResultPolicies
    connector: KVConnectorBase_V1 | None
    pool: BlockPool
    steps: int
    violations: list[str]
    states: dict[str, RequestState]
    waiting: list[str]
    running: list[str]
    stats: dict[str, int]
    recv_steps: dict[str, int]
    _finished_since_last_step: set[str]
    _recved: set[str]
    _held_for_send: dict[str, list[int]]
    _held_for_recv: dict[str, list[int]]
    _aborted: list[RequestOutput]
    groups: WindowGroups | None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def block_tables(self, blocks: Sequence[int], skipped: int = 0) -> tuple[list[int], ...]:
        """The table of each KV-cache group for a request's (logical) `blocks`; `skipped`:
        the window group's leading `NULL_BLOCK` entries (two groups only)."""
        return (list(blocks),) if self.groups is None else self.groups.tables(blocks, skipped)

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled: dict[str, int],
        kv_output: KVConnectorOutput | None,
    ) -> list[RequestOutput]:
        """Apply one step's results: load errors first, then sampled tokens, then transfers."""
        outputs, self._aborted = self._aborted, []
        discard: set[str] = set()
        sendable = set(self._held_for_send)  # request_finished handed these over earlier
        if kv_output is not None:
            for problem in unheld_finished_ids(
                self.states, self._recved, self._held_for_recv, kv_output, sendable
            ):
                self._violate(problem)
            self._recved |= kv_output.finished_recving or set()
            self.recv_steps.update(dict.fromkeys(kv_output.finished_recving or (), self.steps))
            if kv_output.invalid_block_ids:
                stray = stray_load_errors(
                    self.states,
                    self._held_for_recv,
                    kv_output,
                    scheduler_output,
                    self.block_size,
                )
                if stray is not None:
                    self._violate(stray)
            if kv_output.invalid_block_ids or kv_output.failed_recving:
                discard = self._handle_load_errors(kv_output, scheduler_output, outputs)
        for req_id in scheduler_output.num_scheduled_tokens:
            state = self.states.get(req_id)
            if state is None or req_id in discard or state.request.is_finished():
                continue
            req = state.request
            if req.status is not RequestStatus.RUNNING or req.num_computed_tokens < req.num_tokens:
                continue
            token = sampled[req_id]
            req.output_token_ids.append(token)
            if req.num_tokens % self.block_size == 0:
                req.block_hashes = block_hashes(req.all_token_ids, self.block_size)
            finished = len(req.output_token_ids) >= req.max_tokens
            if finished:
                self._finish(state, RequestStatus.FINISHED_LENGTH_CAPPED)
            outputs.append(self._output(state, [token], finished))
        if kv_output is not None:
            for req_id in kv_output.finished_recving or ():
                held = self._held_for_recv.pop(req_id, None)
                if held is not None:
                    self._recved.discard(req_id)
                    self.pool.free(held)
            for req_id in (kv_output.finished_sending or set()) & sendable:
                self.pool.free(self._held_for_send.pop(req_id))
            if self.connector is not None:
                self.connector.update_connector_output(kv_output)
        return outputs

    def _violate(self, message: str) -> None:
        self.violations.append(f"step {self.steps}: {message}")

    def take_violations(self) -> list[str]:
        """Contract violations recorded since the last call."""
        taken, self.violations = self.violations, []
        return taken

    def _handle_load_errors(
        self,
        kv_output: KVConnectorOutput,
        scheduler_output: SchedulerOutput,
        outputs: list[RequestOutput],
    ) -> set[str]:
        """Apply `kv_load_failure_policy` to requests whose loaded blocks failed (as vLLM): the
        request is truncated at its first bad block (recompute) or finished with an error and
        its bad and later blocks evicted from the prefix cache (fail). The ids hit."""
        discard: set[str] = set()
        for state, bad in failed_loads(self.states, kv_output, scheduler_output, self.block_size):
            self.stats["load_errors"] += 1
            self.pool.evict(state.blocks[bad:])
            discard.add(state.request.request_id)
            if self.config.kv_load_failure_policy == "fail":
                self._finish(state, RequestStatus.FINISHED_ERROR)
                outputs.append(self._output(state, [], finished=True))
            else:
                state.request.num_computed_tokens = bad * self.block_size
        return discard

    def _output(
        self, state: RequestState, new_token_ids: list[int], finished: bool
    ) -> RequestOutput:
        req = state.request
        return RequestOutput(
            req.request_id,
            new_token_ids,
            list(req.output_token_ids),
            finished,
            req.status,
            state.kv_transfer_params_out,
        )

    def _finish(self, state: RequestState, status: RequestStatus) -> None:
        req = state.request
        was_loading = req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        req.status = status
        for queue in (self.waiting, self.running):
            if req.request_id in queue:
                queue.remove(req.request_id)
        self._finished_since_last_step.add(req.request_id)
        delay_free, params = False, None
        if self.connector is not None:
            tables = self.block_tables(state.blocks, state.window_skipped)
            if len(tables) == 1:
                delay_free, params = self.connector.request_finished(req, tables[0])
            else:  # the engine refused a connector without SupportsHMA
                hma = cast(SupportsHMA, self.connector)
                delay_free, params = hma.request_finished_all_groups(req, tables)
            if self.config.kv_role == "kv_consumer" and (delay_free or params):
                self._violate(
                    f"role kv_consumer: request_finished({req.request_id!r}) returned "
                    f"({delay_free}, {params}); a pure consumer never holds blocks to send "
                    "nor offers its KV to another engine"
                )
        state.finished_step = self.steps
        state.kv_transfer_params_out = params
        blocks, state.blocks = state.blocks, []
        if was_loading and req.request_id not in self._recved:
            self._held_for_recv[req.request_id] = blocks  # a read may still land in them
        elif delay_free:
            self._held_for_send[req.request_id] = blocks
        else:
            self._recved.discard(req.request_id)
            self.pool.free(blocks)
            if status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
                state.freed_blocks = blocks

    @property
    def received(self) -> set[str]:
        """Requests reported in `finished_recving`, not yet promoted."""
        return self._recved

    def held_blocks(self) -> dict[str, list[int]]:
        """Blocks kept after finish for a connector (sending) or an in-flight read."""
        return {**self._held_for_send, **self._held_for_recv}
