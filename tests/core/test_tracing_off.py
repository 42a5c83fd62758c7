"""Tracing is off by default and free when off: a process that forwards through the proxy's
request builders and finishes requests through the vLLM adapter's facts, with a trace context
in the params, never imports opentelemetry; the same run with `KVX_OTEL=1` does (so the check
can fail)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import sys
from kvx import tracing
from kvx.adapters.request_facts import RequestFacts
from kvx.proxy.forward import decode_request, prefill_request
from kvx.contract.types import KVCacheSpec, Request

ctx = {"kvx_trace": {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}}
with tracing.span("kvx.proxy.request"):
    prefill_request({"prompt": [1]}, tracing.carrier())
    decode_request({"prompt": [1]}, {**ctx, **tracing.carrier()})
facts = RequestFacts("X", "e", KVCacheSpec(("l",), 1, 4, 16), "recompute")
request = Request("r", [1], kv_transfer_params={"do_remote_decode": True, **ctx})
facts.finished(request, [1], True, None)
facts.output([], [], set(), None, finished_sending=["r"])
print(sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")[:3])
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag", ["", "1"])
def test_opentelemetry_is_imported_only_when_tracing_is_on(flag: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVX_OTEL", "OTEL_"))}
    if flag:
        env["KVX_OTEL"] = flag
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=100
    )
    assert run.returncode == 0, run.stderr
    imported = run.stdout.strip().splitlines()[-1]
    if flag:
        assert imported != "[]", imported
    else:
        assert imported == "[]", imported
