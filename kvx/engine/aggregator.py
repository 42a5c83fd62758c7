"""`KVOutputAggregator`: merge the connector outputs of every TP x PP worker of one engine.

Matches vLLM's `KVOutputAggregator`: a request is reported finished (sending or receiving) only
once every worker has reported it, possibly in different steps; invalid blocks are unioned; stats
and worker metadata are merged with `aggregate`; events are concatenated; a failed receive is
held back until the same request is reported finished-receiving. A worker that reports the same
request twice before every worker has reported it is recorded in `violations`: it is still counted
(as vLLM counts reports), so the request looks finished early. A failed receive missing from
the same worker's finished receives is recorded too, then counted as finished.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvx.contract.auxiliary import KVConnectorOutput
from kvx.contract.base import KVConnectorBase_V1


class KVOutputAggregator:
    """Counts per-request reports across workers and steps."""

    def __init__(self, expected_finished_count: int) -> None:
        if expected_finished_count < 1:
            raise ValueError(f"expected_finished_count must be >= 1, got {expected_finished_count}")
        self.expected_finished_count = expected_finished_count
        self._send_remaining: dict[str, int] = {}
        self._recv_remaining: dict[str, int] = {}
        self._failed_pending: set[str] = set()
        self._reporters: dict[tuple[str, str], set[int]] = {}  # (kind, request) -> ranks
        self.violations: list[str] = []

    @classmethod
    def from_connector(cls, connector: KVConnectorBase_V1, world_size: int) -> KVOutputAggregator:
        """Use the connector's `get_finished_count()` override, else the worker count."""
        return cls(connector.get_finished_count() or world_size)

    def _count(
        self,
        kind: str,
        remaining: dict[str, int],
        req_ids: set[str] | None,
        done: set[str],
        rank: int,
    ) -> None:
        for req_id in req_ids or ():
            reporters = self._reporters.setdefault((kind, req_id), set())
            if rank in reporters:
                self.violations.append(
                    f"worker {rank} reported request {req_id!r} in {kind} twice before every "
                    "worker had reported it (each worker reports a request once)"
                )
            reporters.add(rank)
            left = remaining.get(req_id, self.expected_finished_count) - 1
            if left <= 0:
                remaining.pop(req_id, None)
                self._reporters.pop((kind, req_id), None)
                done.add(req_id)
            else:
                remaining[req_id] = left

    def aggregate(
        self, outputs: Sequence[KVConnectorOutput | None], output_rank: int = 0
    ) -> KVConnectorOutput | None:
        """Merge one step's worker outputs; None if the output rank produced nothing."""
        if not outputs or outputs[output_rank] is None:
            return None
        for out in outputs:
            if out is not None and out.expected_finished_count > 0:
                self.expected_finished_count = out.expected_finished_count
        sending: set[str] = set()
        recving: set[str] = set()
        merged = KVConnectorOutput()
        for rank, out in enumerate(outputs):
            if out is None:
                continue
            self._count(
                "finished_sending", self._send_remaining, out.finished_sending, sending, rank
            )
            unfinished = out.failed_recving - (out.finished_recving or set())
            if unfinished:
                self.violations.append(
                    f"rule failed-is-finished: worker {rank} reported {sorted(unfinished)} in "
                    "failed_recving but not in finished_recving (a failed receive is a finished "
                    "one too: only finished_recving ends a load); counted as finished"
                )
            self._count(
                "finished_recving",
                self._recv_remaining,
                (out.finished_recving or set()) | out.failed_recving,
                recving,
                rank,
            )
            self._failed_pending |= out.failed_recving
            merged.invalid_block_ids |= out.invalid_block_ids
            if out.kv_connector_stats is not None:
                if merged.kv_connector_stats is None:
                    merged.kv_connector_stats = out.kv_connector_stats
                else:
                    merged.kv_connector_stats.aggregate(out.kv_connector_stats)
            if out.kv_connector_worker_meta is not None:
                if merged.kv_connector_worker_meta is None:
                    merged.kv_connector_worker_meta = out.kv_connector_worker_meta
                else:
                    merged.kv_connector_worker_meta = merged.kv_connector_worker_meta.aggregate(
                        out.kv_connector_worker_meta
                    )
            if out.kv_cache_events is not None:
                if merged.kv_cache_events is None:
                    merged.kv_cache_events = out.kv_cache_events
                else:
                    merged.kv_cache_events.aggregate(out.kv_cache_events)
        merged.finished_sending = sending or None
        merged.finished_recving = recving or None
        merged.failed_recving = self._failed_pending & recving
        self._failed_pending -= recving
        return merged

    def pending(self) -> dict[str, dict[str, int]]:
        """Requests some but not all workers reported so far (for diagnostics)."""
        return {"sending": dict(self._send_remaining), "recving": dict(self._recv_remaining)}
