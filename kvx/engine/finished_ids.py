"""The contract rule on a step's finished sets: every id in `finished_sending` /
`finished_recving` names a transfer the engine is waiting for, once."""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping

from kvx.contract.auxiliary import KVConnectorOutput
from kvx.contract.types import RequestStatus
from kvx.engine.request_state import RequestState


def unheld_finished_ids(
    states: Mapping[str, RequestState],
    recved: Container[str],
    held_for_recv: Container[str],
    kv_output: KVConnectorOutput,
    sendable: set[str],
) -> Iterator[str]:
    """A violation message per id in the finished sets that names no transfer this engine is
    waiting for (the scheduler's `states`; `recved`, loads already reported; `held_for_recv`,
    loads whose blocks it holds; `sendable`, the requests held for sending before this
    step)."""
    for req_id in sorted((kv_output.finished_sending or set()) - sendable):
        yield (
            f"finished_sending names request {req_id!r}, which this engine does not hold "
            "for sending: request_finished never returned True for it, or it was already "
            "reported finished (ids in finished_sending must be held requests, once each)"
        )
    for req_id in sorted(kv_output.finished_recving or ()):
        state = states.get(req_id)
        loading = (
            state is not None
            and state.request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
            and req_id not in recved
        )
        if not loading and req_id not in held_for_recv:
            yield (
                f"finished_recving names request {req_id!r}, which is not loading "
                "asynchronously on this engine: unknown, never given an async load, or "
                "already reported finished (ids in finished_recving must be loading "
                "requests, once each)"
            )
