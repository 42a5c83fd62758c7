"""Keeps kvx connectors' transfer reports within what vLLM's scheduler can take.

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

One engine may host several kvx connectors: vLLM's own MultiConnector makes each child a kvx
adapter, hands every child the same `KVConnectorOutput` (the children's reports merged) and
frees a request's blocks when any child delayed them. So the adapters of one engine share one
record of what vLLM waits on (keyed by the engine's `KVCacheConfig`, the one object vLLM gives
every child), and only the first of them filters: a guard of its own would drop the reports its
siblings are waited on (a producer then never freed the blocks its NIXL child had sent).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)
LOADING_STATUS = "WAITING_FOR_REMOTE_KVS"


class _Waits:
    """What one engine's scheduler waits on, and the names of the kvx connectors it hosts."""

    def __init__(self) -> None:
        self.loading: set[str] = set()
        self.sending: set[str] = set()
        self.connectors: list[str] = []
        self.filterer: ReportGuard | None = None


_ENGINES: dict[int, _Waits] = {}  # id(engine key) -> its record, dropped with the key


def _waits_of(engine_key: object | None) -> _Waits:
    if engine_key is None:  # no engine object to share by: a record of its own
        return _Waits()
    key = id(engine_key)
    waits = _ENGINES.get(key)
    if waits is None:
        waits = _ENGINES[key] = _Waits()
        weakref.finalize(engine_key, _ENGINES.pop, key, None)
    return waits


class ReportGuard:
    """The requests vLLM waits on a report for (one per scheduler-side adapter; the adapters
    of one engine, `engine_key`, share the record)."""

    def __init__(self, connector_name: str, engine_key: object | None = None) -> None:
        self.connector_name = connector_name
        self._waits = _waits_of(engine_key)
        self._waits.connectors.append(connector_name)
        if self._waits.filterer is None:
            self._waits.filterer = self

    def note_loading(self, vllm_requests: Iterable[Any]) -> None:
        """Called once per step after vLLM scheduled: remember requests it set to wait for an
        asynchronous load (it does so after `update_state_after_alloc`)."""
        for request in vllm_requests:
            if getattr(request.status, "name", None) == LOADING_STATUS:
                self._waits.loading.add(request.request_id)

    def note_finished(self, req_id: str, delay_free_blocks: bool) -> None:
        """`request_finished` answered: a delayed free waits for `finished_sending` (vLLM waits
        once however many of its connectors delayed)."""
        if delay_free_blocks:
            self._waits.sending.add(req_id)

    def filter(self, output: Any) -> None:
        """Drop, in vLLM's `KVConnectorOutput` itself, the reports vLLM is not waiting for
        (once per output: the engine's other kvx adapters see it already filtered)."""
        if self._waits.filterer is not self:
            return
        waits = self._waits
        output.finished_recving = self._keep(output.finished_recving, waits.loading, "receiving")
        output.finished_sending = self._keep(output.finished_sending, waits.sending, "sending")

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
                " or ".join(self._waits.connectors),
                what,
                sorted(stray),
            )
        return kept or None

    @property
    def first(self) -> bool:
        """This adapter is its engine's first kvx adapter (the one answering for all)."""
        return self._waits.filterer is self

    @property
    def pending(self) -> tuple[frozenset[str], frozenset[str]]:
        """(loads, sends) vLLM still waits on: for tests and diagnostics."""
        return frozenset(self._waits.loading), frozenset(self._waits.sending)
