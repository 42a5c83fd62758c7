"""Run the scenarios against one connector config and report (used by the CLI and pytest)."""

from __future__ import annotations

import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvx import Capability, KVTransferConfig, Registry, get_registry
from kvx.conformance.harness import Harness
from kvx.conformance.scenario import SCENARIOS, Scenario, ScenarioFailure

PASSED, FAILED, NOT_CLAIMED = "passed", "FAILED", "not claimed"


@dataclass
class ScenarioResult:
    name: str
    summary: str
    outcome: str
    seconds: float = 0.0
    message: str = ""


def load_scenarios() -> dict[str, Scenario]:
    """Every built-in scenario, in a stable order."""
    from kvx.conformance import scenarios_pd, scenarios_faults, scenarios_contract  # noqa: F401, I001

    return dict(SCENARIOS)


def connector_claims(kv: dict[str, Any], registry: Registry) -> frozenset[Capability]:
    """The capabilities the configured connector class declares."""
    config = KVTransferConfig.from_dict({**kv, "kv_role": "kv_both"}, registry=registry)
    return registry.resolve_connector_class(config).claims_for(config)


class ScenarioTimeout(ScenarioFailure):
    pass


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise `ScenarioTimeout` in the main thread after `seconds` (no-op in other threads)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise ScenarioTimeout(f"scenario did not finish within {seconds:.0f}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_scenario(
    scenario: Scenario,
    kv: dict[str, Any],
    claims: frozenset[Capability],
    registry: Registry,
    fault_timeout_s: float = 60.0,
    enforce_time_limit: bool = True,
) -> ScenarioResult:
    """Run one scenario in a fresh working directory; never raises for a connector's fault."""
    missing = scenario.missing_claims(claims)
    if missing:
        return ScenarioResult(
            scenario.name, scenario.summary, NOT_CLAIMED, message=f"needs {', '.join(missing)}"
        )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"kvx-conf-{scenario.name}-") as workdir:
        harness = Harness(kv, claims, Path(workdir), registry, fault_timeout_s)
        try:
            if enforce_time_limit:
                with time_limit(scenario.timeout_s):
                    scenario.run(harness)
            else:
                scenario.run(harness)
        except ScenarioFailure as exc:
            return ScenarioResult(
                scenario.name, scenario.summary, FAILED, time.perf_counter() - start, str(exc)
            )
        except Exception as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            return ScenarioResult(
                scenario.name,
                scenario.summary,
                FAILED,
                time.perf_counter() - start,
                f"{type(exc).__name__}: {exc} (at {Path(where.filename).name}:{where.lineno})",
            )
    return ScenarioResult(scenario.name, scenario.summary, PASSED, time.perf_counter() - start)


def run_suite(
    kv: dict[str, Any],
    *,
    only: list[str] | None = None,
    registry: Registry | None = None,
    fault_timeout_s: float = 60.0,
    on_result: Callable[[ScenarioResult], None] | None = None,
) -> list[ScenarioResult]:
    """Run every scenario (or `only` these) against the connector configured by `kv`."""
    registry = registry or get_registry()
    claims = connector_claims(kv, registry)
    scenarios = load_scenarios()
    unknown = sorted(set(only or ()) - set(scenarios))
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; known: {sorted(scenarios)}")
    results = []
    for name, scenario in scenarios.items():
        if only and name not in only:
            continue
        result = run_scenario(scenario, kv, claims, registry, fault_timeout_s)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def markdown_report(
    kv: dict[str, Any], claims: frozenset[Capability], results: list[ScenarioResult]
) -> str:
    passed = sum(r.outcome == PASSED for r in results)
    failed = sum(r.outcome == FAILED for r in results)
    lines = [
        f"# kvx conformance report: {kv.get('kv_connector')}",
        "",
        f"- claims: {', '.join(sorted(c.value for c in claims)) or 'none'}",
        f"- {passed} passed, {failed} failed, {len(results) - passed - failed} not claimed",
        "",
        "| scenario | result | seconds | details |",
        "|---|---|---|---|",
    ]
    for r in results:
        detail = (r.message or r.summary).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.name} | {r.outcome} | {r.seconds:.1f} | {detail} |")
    return "\n".join(lines) + "\n"
