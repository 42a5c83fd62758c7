"""pytest integration: `pytest -p kvx.conformance --kvx-config '<json>'`.

Every scenario becomes a test item named `kvx-conformance::<scenario>`; scenarios outside the
connector's claims are reported as skipped with the reason "not claimed: ...", never dropped.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvx import Capability, get_registry
from kvx.config import load_cli_arg
from kvx.conformance.runner import (
    FAILED,
    NOT_CLAIMED,
    connector_claims,
    load_scenarios,
    run_scenario,
)
from kvx.conformance.scenario import Scenario, ScenarioFailure
from kvx.errors import ConfigError, RegistryError


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvx", "kvx connector conformance")
    group.addoption(
        "--kvx-config",
        metavar="JSON|@FILE",
        default=None,
        help="connector config to run the kvx conformance suite against",
    )
    group.addoption(
        "--kvx-fault-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long fault scenarios wait for a connector to give up",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    raw = config.getoption("kvx_config")
    if raw is None:
        return
    try:
        kv = load_cli_arg(raw)
        if not isinstance(kv, dict):
            raise ConfigError([])
        claims = connector_claims(kv, get_registry())
    except (ConfigError, RegistryError) as exc:
        raise pytest.UsageError(f"--kvx-config: {exc}") from None
    suite = ConformanceSuite.from_parent(session, name="kvx-conformance")
    suite.kv, suite.claims = kv, claims
    items.extend(suite.collect())


class ConformanceSuite(pytest.Collector):
    kv: dict[str, Any]
    claims: frozenset[Capability]

    def collect(self) -> list[pytest.Item]:
        return [
            ScenarioItem.from_parent(self, name=name, scenario=scenario)
            for name, scenario in load_scenarios().items()
        ]


class ScenarioItem(pytest.Item):
    def __init__(self, *, scenario: Scenario, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scenario = scenario
        self.add_marker(pytest.mark.timeout(scenario.timeout_s))

    def runtest(self) -> None:
        suite = self.parent
        assert isinstance(suite, ConformanceSuite)
        result = run_scenario(
            self.scenario,
            suite.kv,
            suite.claims,
            get_registry(),
            self.config.getoption("kvx_fault_timeout"),
            enforce_time_limit=False,
        )
        if result.outcome == NOT_CLAIMED:
            pytest.skip(f"not claimed: {result.message}")
        if result.outcome == FAILED:
            raise ScenarioFailure(result.message)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, ScenarioFailure):
            return f"{self.scenario.name}: {excinfo.value}"
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "kvx-conformance", None, f"kvx conformance: {self.scenario.name}"
