"""Which requests a step's load errors hit, and from which block: the half of
`kv_load_failure_policy` that reads the step (the scheduler applies the policy)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

from kvx.contract.auxiliary import KVConnectorOutput
from kvx.contract.types import RequestStatus, SchedulerOutput
from kvx.engine.request_state import RequestState


def failed_loads(
    states: Mapping[str, RequestState],
    kv_output: KVConnectorOutput,
    scheduler_output: SchedulerOutput,
    block_size: int,
) -> Iterator[tuple[RequestState, int]]:
    """Each unfinished request whose loaded KV failed, with the index of its first bad block.

    Matches vLLM: only blocks that may hold externally computed tokens are checked (an async
    load's whole span; a sync load's tokens, when loaded in this step); a request named in
    `failed_recving` fails from its first block.
    """
    invalid = kv_output.invalid_block_ids
    for req_id, state in list(states.items()):
        req = state.request
        if req.is_finished():
            continue
        if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            loaded = req.num_computed_tokens
        elif state.sync_loaded_tokens and req_id in scheduler_output.num_scheduled_tokens:
            loaded = req.num_computed_tokens - scheduler_output.num_scheduled_tokens[req_id]
        else:
            continue
        span = state.blocks[: math.ceil(loaded / block_size)]
        bad = next((i for i, b in enumerate(span) if b in invalid), None)
        if req_id in kv_output.failed_recving:
            bad = 0
        if bad is not None:
            yield state, bad
