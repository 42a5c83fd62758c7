"""Run the scenarios against one connector config and judge the run (the Python API; the CLI
and the pytest kit are thin layers over it)."""

from __future__ import annotations

import json
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvx import Capability, KVTransferConfig, Registry, get_registry
from kvx.conformance.harness import Harness
from kvx.conformance.options import SuiteOptions
from kvx.conformance.scenario import SCENARIOS, Scenario, ScenarioFailure
from kvx.engine.server import EngineError
from kvx.errors import did_you_mean

PASSED, FAILED, NOT_CLAIMED, NOT_RUN = "passed", "FAILED", "not claimed", "not run"
OUTCOMES = (PASSED, FAILED, NOT_CLAIMED, NOT_RUN)


@dataclass
class ScenarioResult:
    """One scenario's outcome (one of `OUTCOMES`); `message` says why it failed or was not
    claimed (or not run, after `fail_fast`)."""

    name: str
    summary: str
    outcome: str
    seconds: float = 0.0
    message: str = ""


@dataclass
class SuiteResult(Sequence[ScenarioResult]):
    """A whole run: what the connector claims, each scenario's result (it is the sequence of
    them, in suite order), and the verdict (`ok`, `exit_code`, `summary`)."""

    connector: str
    claims: frozenset[Capability]
    results: list[ScenarioResult] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.results)

    def __getitem__(self, index: Any) -> Any:
        return self.results[index]

    def count(self, outcome: str) -> int:
        return sum(r.outcome == outcome for r in self.results)

    @property
    def transfers_tested(self) -> list[str]:
        """Passed scenarios that moved KV (a P/D hand-off, a store or an offload)."""
        scenarios = load_scenarios()
        return [r.name for r in self.results if r.outcome == PASSED and scenarios[r.name].transfers]

    def ok(self, allow_no_transfer: bool = False) -> bool:
        """No scenario failed, and (unless allowed) some scenario moved KV."""
        return not self.count(FAILED) and (allow_no_transfer or bool(self.transfers_tested))

    def exit_code(self, allow_no_transfer: bool = False) -> int:
        return 0 if self.ok(allow_no_transfer) else 1

    def summary(self) -> str:
        """Counts, then what was actually tested."""
        counts = ", ".join(
            f"{self.count(o)} {o.lower()}" for o in OUTCOMES if o != NOT_RUN or self.count(o)
        )
        tested = self.transfers_tested
        if tested:
            return f"{counts}; KV transfers tested by: {', '.join(tested)}"
        return f"{counts}; {no_transfer_message(self.connector, self.claims)}"


def no_transfer_message(connector: str, claims: frozenset[Capability]) -> str:
    claimed = ", ".join(sorted(c.value for c in claims)) or "nothing"
    return (
        f"NO KV transfer was tested: {connector} claims {claimed}, which leaves no passing "
        "scenario that moves KV (claim remote_prefill, store_reuse or offload; accept this "
        "with --allow-no-transfer / allow_no_transfer=True)"
    )


def role_note(kv: dict[str, Any]) -> str | None:
    """What the run says when the config names a `kv_role`: each scenario sets its own."""
    role = kv.get("kv_role")
    if role is None:
        return None
    return (
        f"note: the config's kv_role {role!r} is not used; each scenario gives every engine "
        "the role docs/conformance.md lists (P/D: P kv_producer, D kv_consumer)"
    )


def load_scenarios() -> dict[str, Scenario]:
    """Every built-in scenario, in a stable order."""
    from kvx.conformance import (  # noqa: F401, I001
        scenarios_pd,
        scenarios_faults,
        scenarios_contract,
        scenarios_roles,
        scenarios_mla,
        scenarios_window,
        scenarios_groups,
        scenarios_matrix,
    )

    return dict(SCENARIOS)


def connector_claims(kv: dict[str, Any], registry: Registry) -> frozenset[Capability]:
    """The capabilities the configured connector class declares."""
    config = KVTransferConfig.from_dict({**kv, "kv_role": "kv_both"}, registry=registry)
    return registry.resolve_connector_class(config).claims_for(config)


class ScenarioTimeout(ScenarioFailure):
    pass


@contextmanager
def time_limit(seconds: float, describe: Callable[[], str]) -> Iterator[None]:
    """Raise `ScenarioTimeout` (with `describe()` of what is stuck) in the main thread after
    `seconds`; no limit in other threads."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: object) -> None:
        try:
            state = describe()
        except Exception as exc:  # describing must not hide the timeout
            state = f"(could not describe the engines: {exc})"
        raise ScenarioTimeout(f"scenario did not finish within {seconds:.0f}s: {state}")

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
    options: SuiteOptions | None = None,
) -> ScenarioResult:
    """Run one scenario in a fresh working directory; never raises for a connector's fault."""
    options = options or SuiteOptions()
    missing = scenario.missing_claims(claims)
    if missing:
        return ScenarioResult(
            scenario.name, scenario.summary, NOT_CLAIMED, message=f"needs {', '.join(missing)}"
        )
    start = time.perf_counter()

    def failed(message: str) -> ScenarioResult:
        return ScenarioResult(
            scenario.name, scenario.summary, FAILED, time.perf_counter() - start, message
        )

    with tempfile.TemporaryDirectory(prefix=f"kvx-conf-{scenario.name}-") as workdir:
        harness = Harness(kv, claims, Path(workdir), registry, options, scenario.name)
        try:
            with time_limit(options.scenario_timeout_s or scenario.timeout_s, harness.describe):
                scenario.run(harness)
        except ScenarioFailure as exc:
            return failed(str(exc))
        except EngineError as exc:
            return failed(f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            return failed(
                f"{type(exc).__name__}: {exc} (at {Path(where.filename).name}:{where.lineno})"
            )
    return ScenarioResult(scenario.name, scenario.summary, PASSED, time.perf_counter() - start)


def run_suite(
    kv: dict[str, Any],
    *,
    only: list[str] | None = None,
    registry: Registry | None = None,
    options: SuiteOptions | None = None,
    fault_timeout_s: float | None = None,
    fail_fast: bool = False,
    on_result: Callable[[ScenarioResult], None] | None = None,
) -> SuiteResult:
    """Run every scenario (or `only` these) against the connector configured by `kv`.

    `options` bound the run (`fault_timeout_s` alone overrides just that field). With
    `fail_fast` the scenarios after the first failure are reported `NOT_RUN`. Raises
    `ValueError` for an unknown scenario name and `kvx.errors.ConfigError` /
    `RegistryError` for a config that names no usable connector.
    """
    registry = registry or get_registry()
    options = options or SuiteOptions()
    if fault_timeout_s is not None:
        options = replace(options, fault_timeout_s=fault_timeout_s)
    claims = connector_claims(kv, registry)
    scenarios = load_scenarios()
    unknown = sorted(set(only or ()) - set(scenarios))
    if unknown:
        hints = "".join(did_you_mean(name, scenarios) for name in unknown)
        raise ValueError(f"unknown scenario(s) {unknown}{hints}; known: {sorted(scenarios)}")
    suite = SuiteResult(str(kv.get("kv_connector")), claims)
    for name, scenario in scenarios.items():
        if only and name not in only:
            continue
        if fail_fast and suite.count(FAILED):
            result = ScenarioResult(name, scenario.summary, NOT_RUN, message="--fail-fast")
        else:
            result = run_scenario(scenario, kv, claims, registry, options)
        suite.results.append(result)
        if on_result is not None:
            on_result(result)
    return suite


def markdown_report(kv: dict[str, Any], suite: SuiteResult) -> str:
    lines = [
        f"# kvx conformance report: {kv.get('kv_connector')}",
        "",
        f"- config: `{json.dumps(kv)}`",
        f"- claims: {', '.join(sorted(c.value for c in suite.claims)) or 'none'}",
        f"- {suite.summary()}",
        "",
        "| scenario | roles | result | seconds | details |",
        "|---|---|---|---|---|",
    ]
    scenarios = load_scenarios()
    for r in suite.results:
        detail = (r.message or r.summary).replace("|", "\\|").replace("\n", " ")
        roles = scenarios[r.name].roles
        lines.append(f"| {r.name} | {roles} | {r.outcome} | {r.seconds:.1f} | {detail} |")
    return "\n".join(lines) + "\n"
