"""kvx_* Prometheus series in `vllm serve`'s own /metrics, from any kvx connector's stats.

vLLM hands `observe` each engine step's stats (merged across workers) as a plain dict; the
connector's stats type rebuilds them and gives `kvx.TransferFigures`, the shape every built-in
shares. Series carry vLLM's labels (`model_name`, `engine`), `connector` (a MultiConnector's
child, or the connector itself) and their own (`direction`, `source`, `kind`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

import kvx

logger = logging.getLogger(__name__)

SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Transfer durations: sub-millisecond CPU copies up to multi-second network reads."""

SERIES: dict[str, tuple[type, str, str]] = {
    # attribute: (kind, name, help); the extra label is in `LABEL`
    "bytes": (Counter, "kvx_kv_transfer_bytes", "KV cache bytes moved by kvx connectors."),
    "blocks": (Counter, "kvx_kv_transfer_blocks", "KV cache blocks moved by kvx connectors."),
    "seconds": (
        Histogram,
        "kvx_kv_transfer_duration_seconds",
        "Duration of one kvx KV transfer (a read, write or copy).",
    ),
    "hits": (Counter, "kvx_kv_hit_tokens", "Prompt tokens whose KV a source or tier served."),
    "failures": (Counter, "kvx_kv_transfer_failures", "Failed kvx KV transfers, by kind."),
    "held": (Gauge, "kvx_kv_held_requests", "Requests whose KV blocks P holds for D now."),
    "held_age": (
        Gauge,
        "kvx_kv_held_oldest_seconds",
        "How long the oldest request held for D has been held.",
    ),
}
LABEL = {
    "bytes": "direction",
    "blocks": "direction",
    "seconds": "direction",
    "hits": "source",
    "failures": "kind",
}

_CREATED: dict[str, Any] = {}
"""Metrics by name, made once per process: several kvx children of one vLLM MultiConnector
share them (prometheus_client refuses a second registration of a name)."""


def _metric(attr: str, metric_types: dict[Any, Any], labelnames: list[str]) -> Any:
    kind, name, documentation = SERIES[attr]
    if name not in _CREATED:
        labels = [*labelnames, "connector", *([LABEL[attr]] if attr in LABEL else [])]
        kwargs: dict[str, Any] = {"buckets": SECONDS_BUCKETS} if kind is Histogram else {}
        if kind is Gauge:
            kwargs["multiprocess_mode"] = "mostrecent"
        _CREATED[name] = metric_types[kind](
            name=name, documentation=documentation, labelnames=labels, **kwargs
        )
    return _CREATED[name]


class KvxPromMetrics(KVConnectorPromMetrics):
    """Records each observation's `TransferFigures` into the kvx_* series."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        rebuild: Callable[[dict[str, Any]], kvx.KVConnectorStats],
        connector: str,
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._rebuild, self._connector = rebuild, connector
        self._metrics = {attr: _metric(attr, metric_types, labelnames) for attr in SERIES}
        self._warned = False
        self._children: dict[tuple[object, ...], Any] = {}
        # failure series exist at 0 from the start, so an alert on their rate works at once
        for name in rebuild({}).figures_by_connector(connector):
            for labels in per_engine_labelvalues.values():
                for kind in kvx.FAILURE_KINDS:
                    self._metrics["failures"].labels(*labels, name, kind)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Never raises: a bad observation costs a warning, not vLLM's output handler."""
        try:
            stats = self._rebuild(transfer_stats_data)
            for name, figures in stats.figures_by_connector(self._connector).items():
                self._record(figures, [*self.per_engine_labelvalues[engine_idx], name])
        except Exception as exc:
            if not self._warned:
                self._warned = True
                logger.warning("kvx: stats not recorded in Prometheus: %s: %s", type(exc), exc)

    def _child(self, attr: str, *labels: object) -> Any:
        """The labelled series (looked up once: `observe` runs every engine step)."""
        key = (attr, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._metrics[attr].labels(*labels)
        return child

    def _record(self, f: kvx.TransferFigures, labels: list[object]) -> None:
        for attr, by_key in (("bytes", f.bytes), ("blocks", f.blocks), ("hits", f.hits)):
            for key, value in by_key.items():
                child = self._child(attr, *labels, key)  # the series exists from its first report
                if value:
                    child.inc(value)
        for kind, count in f.failures.items():
            if count:
                self._child("failures", *labels, kind).inc(count)
        for direction, durations in f.seconds.items():
            histogram = self._child("seconds", *labels, direction)
            for seconds in durations:
                histogram.observe(seconds)
        if f.held_requests is not None:
            self._child("held", *labels).set(f.held_requests)
            self._child("held_age", *labels).set(f.held_oldest_seconds or 0.0)
