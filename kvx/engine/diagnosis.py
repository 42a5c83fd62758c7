"""Stall diagnosis for the reference engine: what keeps a scheduler busy, request by request.

Reads the scheduler's own bookkeeping (this package's private state) and says, for each request
that is open, which blocks it holds and which connector report the engine waits for, so a stalled
run fails with what is stuck instead of a bare timeout.
"""

from __future__ import annotations

from kvx.contract.types import RequestStatus
from kvx.engine.scheduler import Scheduler


def diagnose(scheduler: Scheduler, pending: dict[str, dict[str, int]] | None = None) -> list[str]:
    """One line per request that keeps this engine busy: what it holds and which
    connector report the engine waits for. `pending` is the output aggregator's partial
    reports (request -> workers still to report)."""
    pending = pending or {"sending": {}, "recving": {}}
    lines = []
    for req_id, blocks in scheduler._held_for_send.items():
        left = pending["sending"].get(req_id)
        lines.append(
            f"request {req_id} finished at step {scheduler.states[req_id].finished_step}; blocks "
            f"{blocks} held for sending: the engine waits for get_finished() to report it "
            "in finished_sending"
            + (f" ({left} worker(s) still to report)" if left else " (no worker has)")
        )
    for req_id, blocks in scheduler._held_for_recv.items():
        lines.append(
            f"request {req_id} aborted while loading; blocks {blocks} held until "
            "get_finished() reports it in finished_recving"
        )
    for req_id in scheduler.waiting:
        state = scheduler.states[req_id]
        req = state.request
        if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            left = pending["recving"].get(req_id)
            what = (
                "arrived, awaiting promotion"
                if req_id in scheduler._recved
                else (
                    "the engine waits for get_finished() to report it in finished_recving"
                    + (f" ({left} worker(s) still to report)" if left else " (no worker has)")
                )
            )
            lines.append(
                f"request {req_id} loads its KV asynchronously into blocks {state.blocks}: " + what
            )
        elif state.asked_later:
            lines.append(
                f"request {req_id} waiting: get_num_new_matched_tokens answered None "
                "(ask again later) at its last try"
            )
        else:
            lines.append(f"request {req_id} waiting for free blocks ({req.status.value})")
    for req_id in scheduler.running:
        state = scheduler.states[req_id]
        lines.append(
            f"request {req_id} running with blocks {state.blocks} "
            f"({state.request.num_computed_tokens} of {state.request.num_tokens} tokens)"
        )
    return lines
