"""Which requests a step's load errors hit, and from which block: the half of
`kv_load_failure_policy` that reads the step (the scheduler applies the policy); and the
errors that name blocks no load wrote into (rule load-errors-name-loaded-blocks)."""

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


def stray_load_errors(
    states: Mapping[str, RequestState],
    held_for_recv: Mapping[str, list[int]],
    kv_output: KVConnectorOutput,
    scheduler_output: SchedulerOutput,
    block_size: int,
) -> str | None:
    """The breach of rule load-errors-name-loaded-blocks, if any: load errors naming blocks
    that no load wrote into. A load's blocks are an asynchronous load's whole table (while it
    waits for its KV, or is held after an abort), and a synchronous load's span up to its last
    loaded token in the step that loaded it."""
    targeted: set[int] = set()
    for blocks in held_for_recv.values():
        targeted.update(blocks)
    for req_id, state in states.items():
        req = state.request
        if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            targeted.update(state.blocks)
        elif state.sync_loaded_tokens and req_id in scheduler_output.num_scheduled_tokens:
            loaded = req.num_computed_tokens - scheduler_output.num_scheduled_tokens[req_id]
            targeted.update(state.blocks[: math.ceil(loaded / block_size)])
    stray = sorted(set(kv_output.invalid_block_ids) - targeted)
    if not stray:
        return None
    shown = ", ".join(map(str, stray[:8])) + (", ..." if len(stray) > 8 else "")
    return (
        f"rule load-errors-name-loaded-blocks: the connector reported load errors for blocks "
        f"[{shown}] ({len(stray)} of {len(kv_output.invalid_block_ids)}), which no load wrote "
        f"into (this step's loads and the asynchronous ones in flight hold {len(targeted)} "
        "blocks); vLLM maps a load error only to a request whose loaded blocks hold it "
        "(scheduler.py _update_requests_with_invalid_blocks) and ignores the rest, so the "
        "failed load they stand for goes unnoticed (or a running request recomputes)"
    )
