"""Optional OpenTelemetry traces across `kvx proxy` -> P -> D (`pip install kvx[otel]`).

Off unless `KVX_OTEL=1`; while off no function here imports `opentelemetry`, so tracing costs
an environment lookup per request. When on, the proxy opens a request span with one child per
leg and puts the W3C trace context (`traceparent`, `tracestate`) in the `kv_transfer_params` it
sends P and D under `TRACE_KEY`; each engine's vLLM adapter adds its spans to that trace
(`engine_span`): P's prefill and hand-off, D's load (docs/observability.md).

Spans go to whatever tracer provider the process has; `setup_from_env` gives a process without
one an OTLP/HTTP exporter when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

from kvx.errors import MissingDependencyError

TRACE_KEY = "kvx_trace"
"""The `kv_transfer_params` key carrying the trace context: `{"traceparent": ..., ...}`."""

ENV = "KVX_OTEL"
_MAX_CARRIER_CHARS = 512  # a traceparent is 55 chars; tracestate is bounded by its spec at 512


ON, OFF = ("1", "true", "yes"), ("", "0", "false", "no")


def enabled() -> bool:
    """`KVX_OTEL` is `1`/`true`/`yes` (read on every call: tests and operators flip it)."""
    return os.environ.get(ENV, "").strip().lower() in ON


def _tracer() -> Any:
    from opentelemetry import trace

    return trace.get_tracer("kvx")


@contextlib.contextmanager
def span(name: str, attributes: Mapping[str, Any] | None = None) -> Iterator[None]:
    """A span around the block, child of the current one (nothing when tracing is off)."""
    if not enabled():
        yield
        return
    with _tracer().start_as_current_span(name, attributes=dict(attributes or {})):
        yield


def carrier() -> dict[str, dict[str, str]]:
    """`{TRACE_KEY: context}` of the current span, to merge into `kv_transfer_params`; empty
    when tracing is off or no span is current."""
    if not enabled():
        return {}
    from opentelemetry import propagate

    context: dict[str, str] = {}
    propagate.inject(context)
    return {TRACE_KEY: context} if context else {}


def parent_of(params: Mapping[str, Any] | None) -> Any | None:
    """The OpenTelemetry context carried in a request's `kv_transfer_params` (None when off or
    absent). The carrier comes from a client or a peer: only short string fields are read."""
    if not enabled() or not params:
        return None
    given = params.get(TRACE_KEY)
    if not isinstance(given, dict):
        return None
    fields = {
        k: v
        for k, v in given.items()
        if k in ("traceparent", "tracestate")
        and isinstance(v, str)
        and len(v) <= _MAX_CARRIER_CHARS
    }
    if "traceparent" not in fields:
        return None
    from opentelemetry import propagate

    return propagate.extract(fields)


_wall_offset_ns: list[int] = []


def _wall_ns(monotonic: float) -> int:
    """A `time.monotonic()` reading as epoch nanoseconds (one offset per process, so spans
    converted at different times keep their order)."""
    if not _wall_offset_ns:
        _wall_offset_ns.append(time.time_ns() - int(time.monotonic() * 1e9))
    return _wall_offset_ns[0] + int(monotonic * 1e9)


def engine_span(
    name: str, parent: Any, started: float, ended: float, attributes: Mapping[str, Any]
) -> None:
    """Record a finished span `name` under `parent` (from `parent_of`); `started` and `ended`
    are `time.monotonic()` readings."""
    attrs = {k: v for k, v in attributes.items() if isinstance(v, (str, bool, int, float))}
    done = _tracer().start_span(
        name, context=parent, start_time=_wall_ns(started), attributes=attrs
    )
    done.end(end_time=_wall_ns(ended))


def setup_from_env() -> bool:
    """Called once at a process's start: checks `KVX_OTEL` (ValueError naming the value and
    what is allowed; MissingDependencyError without the `otel` extra), then, with tracing on,
    no tracer provider set yet and an OTLP endpoint in the environment, installs the SDK's
    provider exporting over OTLP/HTTP; True if it did."""
    value = os.environ.get(ENV, "")
    if value.strip().lower() not in ON + OFF:
        raise ValueError(
            f"{ENV}: {value!r} is not allowed; use 1, true or yes (on) or 0, false, no (off)"
        )
    if not enabled():
        return False
    if importlib.util.find_spec("opentelemetry") is None:
        raise MissingDependencyError(
            f"{ENV}=1 needs OpenTelemetry, which is not installed: pip install 'kvx[otel]'"
        )
    if not (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        return False
    from opentelemetry import trace

    if type(trace.get_tracer_provider()).__name__ != "ProxyTracerProvider":
        return False  # the process set up its own
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(
        resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "kvx")})
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True
