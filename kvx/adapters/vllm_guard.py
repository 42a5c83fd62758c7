"""Keeps a connector's transfer reports within what vLLM's scheduler can take.

vLLM 0.32's scheduler trusts every id a connector reports: an id in `finished_recving` or
`finished_sending` whose request it no longer holds fails `assert req_id in self.requests`
(`_update_from_kv_xfer_finished`) and kills the engine core, and a report for a live request it
is not waiting on fails another assert or frees blocks still in use. vLLM waits for exactly
these reports:

- `finished_recving` for a request in `WAITING_FOR_REMOTE_KVS` (an asynchronous load), also
  after the request was aborted or failed while loading (vLLM then holds it until the report);
- `finished_sending` for a request whose `request_finished` returned `delay_free_blocks=True`.

The guard records both from the scheduler-side calls and drops any other id before vLLM reads
the output (`update_connector_output` runs first), logging it, so a connector's stray report
costs a warning, never the engine. Attribute access only (no vLLM import).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)
LOADING_STATUS = "WAITING_FOR_REMOTE_KVS"


class ReportGuard:
    """The requests vLLM waits on a connector's report for (one per scheduler-side adapter)."""

    def __init__(self, connector_name: str) -> None:
        self.connector_name = connector_name
        self._loading: set[str] = set()
        self._sending: set[str] = set()

    def note_loading(self, vllm_requests: Iterable[Any]) -> None:
        """Called once per step after vLLM scheduled: remember requests it set to wait for an
        asynchronous load (it does so after `update_state_after_alloc`)."""
        for request in vllm_requests:
            if getattr(request.status, "name", None) == LOADING_STATUS:
                self._loading.add(request.request_id)

    def note_finished(self, req_id: str, delay_free_blocks: bool) -> None:
        """`request_finished` answered: a delayed free waits for `finished_sending`."""
        if delay_free_blocks:
            self._sending.add(req_id)

    def filter(self, output: Any) -> None:
        """Drop, in vLLM's `KVConnectorOutput` itself, the reports vLLM is not waiting for."""
        output.finished_recving = self._keep(output.finished_recving, self._loading, "receiving")
        output.finished_sending = self._keep(output.finished_sending, self._sending, "sending")

    def _keep(self, reported: set[str] | None, waited: set[str], what: str) -> set[str] | None:
        if not reported:
            return reported
        kept = reported & waited
        waited -= kept
        stray = reported - kept
        if stray:
            logger.warning(
                "kvx connector %s reported finished %s for request(s) %s that vLLM is not "
                "waiting on; ignored (vLLM would stop the engine on them)",
                self.connector_name,
                what,
                sorted(stray),
            )
        return kept or None

    @property
    def pending(self) -> tuple[frozenset[str], frozenset[str]]:
        """(loads, sends) vLLM still waits on: for tests and diagnostics."""
        return frozenset(self._loading), frozenset(self._sending)
