"""OpenTelemetry traces across `kvx proxy` -> P -> D (`KVX_OTEL=1`), with the SDK's in-memory
exporter: the proxy opens the request span and one span per leg, the trace context reaches P
and D in `kv_transfer_params`, and the engines' spans (the vLLM adapter's request facts) join
that trace under the right leg. Upstreams are the stub servers of upstream_server.py (real
HTTP); the engine side is the adapter's `RequestFacts` fed the params the stubs received."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvx.adapters.request_facts import RequestFacts
from kvx.contract.types import KVCacheBlocks, KVCacheSpec, Request
from kvx.tracing import TRACE_KEY

pytestmark = pytest.mark.timeout(60)
EXPORTER = InMemorySpanExporter()
CACHE = KVCacheSpec(("l0",), num_kv_heads=1, head_size=4, block_size=16)


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # the first test of the process sets it up
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    if not getattr(provider, "kvx_test_exporter", False):
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        provider.kvx_test_exporter = True  # type: ignore[attr-defined]
    monkeypatch.setenv("KVX_OTEL", "1")
    EXPORTER.clear()
    yield EXPORTER
    EXPORTER.clear()


def by_name(exported: tuple[ReadableSpan, ...] | list[ReadableSpan]) -> dict[str, ReadableSpan]:
    out = {s.name: s for s in exported}
    assert len(out) == len(exported), [s.name for s in exported]
    return out


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def test_one_trace_from_the_proxy_through_p_and_d(
    spans, stub, start_proxy, client, wait_until
) -> None:
    p, d = stub("P"), stub("D")
    proxy = start_proxy([p.url], [d.url])
    wait_until(lambda: client.get(f"{proxy.url}/health").status_code == 200, 10, "ready")
    answer = client.post(f"{proxy.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    wait_until(lambda: len(spans.get_finished_spans()) == 3, 5, "the proxy's spans")
    proxy_spans = by_name(spans.get_finished_spans())
    root = proxy_spans["kvx.proxy.request"]
    assert root.parent is None
    assert root.attributes["kvx.request_id"] == answer.headers["x-request-id"]
    legs = {leg: proxy_spans[f"kvx.proxy.{leg}"] for leg in ("prefill", "decode")}
    for leg in legs.values():
        assert leg.context.trace_id == root.context.trace_id
        assert parent_id(leg) == root.context.span_id
    p_params = p.behaviour.completions()[0].body["kv_transfer_params"]
    d_params = d.behaviour.completions()[0].body["kv_transfer_params"]
    for params, leg in ((p_params, legs["prefill"]), (d_params, legs["decode"])):
        _, trace_id, span_id, _ = params[TRACE_KEY]["traceparent"].split("-")
        assert (int(trace_id, 16), int(span_id, 16)) == (leg.context.trace_id, leg.context.span_id)

    # P's and D's adapters, given what P and D received
    spans.clear()
    p_facts, d_facts = (RequestFacts(n, n, CACHE, "recompute") for n in ("P", "D"))
    prefill = Request("req-p", list(range(40)), kv_transfer_params=p_params)
    p_facts.arrived("req-p")
    p_facts.finished(prefill, [1, 2, 3], True, None)  # P holds the blocks for D
    decode = Request("req-d", list(range(40)), kv_transfer_params=d_params)
    d_facts.arrived("req-d")
    d_facts.matched("req-d", is_async=True)
    d_facts.allocated(decode, KVCacheBlocks(([4, 5, 6],), (0,)), 40)
    d_facts.output(["req-d"], [], set(), None)
    d_facts.finished(decode, [4, 5, 6], False, None)
    p_facts.output([], [], set(), None, finished_sending=["req-p"])  # D read them
    engine = by_name(spans.get_finished_spans())
    assert set(engine) == {"kvx.prefill", "kvx.handoff", "kvx.decode", "kvx.load"}
    for name, leg in (("prefill", "prefill"), ("handoff", "prefill"), ("decode", "decode")):
        span = engine[f"kvx.{name}"]
        assert span.context.trace_id == root.context.trace_id, name
        assert parent_id(span) == legs[leg].context.span_id, name
    assert parent_id(engine["kvx.load"]) == legs["decode"].context.span_id
    load = engine["kvx.load"].attributes
    assert (load["kvx.load.tokens"], load["kvx.load.outcome"]) == (40, "loaded")
    assert engine["kvx.prefill"].attributes["kvx.kept.held"] is True
    assert engine["kvx.handoff"].start_time >= engine["kvx.prefill"].end_time


def test_off_by_default_no_context_travels_and_no_span_is_made(
    spans, stub, start_proxy, client, wait_until, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVX_OTEL")
    p, d = stub("P"), stub("D")
    proxy = start_proxy([p.url], [d.url])
    wait_until(lambda: client.get(f"{proxy.url}/health").status_code == 200, 10, "ready")
    answer = client.post(f"{proxy.url}/v1/completions", json={"prompt": [1], "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    assert TRACE_KEY not in p.behaviour.completions()[0].body["kv_transfer_params"]
    assert TRACE_KEY not in d.behaviour.completions()[0].body["kv_transfer_params"]
    facts = RequestFacts("P", "P", CACHE, "recompute")
    carried = {TRACE_KEY: {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}}
    facts.finished(Request("r", [1], kv_transfer_params=carried), [1], True, None)
    assert spans.get_finished_spans() == ()


def test_a_hostile_trace_context_is_ignored(spans) -> None:
    facts = RequestFacts("D", "D", CACHE, "recompute")
    for bad in ("x", {"traceparent": 7}, {"traceparent": "0" * 600}, {"tracestate": "a=b"}):
        facts.finished(Request("r", [1], kv_transfer_params={TRACE_KEY: bad}), [], False, None)
    assert spans.get_finished_spans() == ()
