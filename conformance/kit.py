"""The conformance suite as test classes for a connector author's own pytest.

In the shape of fsspec's abstract tests: one base class per scenario group, each scenario a
plain test method, parametrised by fixtures the author provides. A test file of three lines
runs the whole suite with ordinary item ids, counts, `-k`, `-x` and xfail:

    from kvx.conformance.kit import AllScenarios

    class TestMyConnector(AllScenarios):
        pass

and the author's `conftest.py` (or the class) defines the connector config:

    @pytest.fixture
    def kvx_config(redis_url):  # any fixture: start a service, hand its URL in
        return {"kv_connector": "MyConnector", "kv_connector_extra_config": {"url": redis_url}}

A parametrised `kvx_config` fixture (or two classes) runs several configs in one session.
`kvx_options` (timeouts), `kvx_allow_no_transfer`, `kvx_fail_fast` (skip a config's remaining
scenarios after its first failure) and `kvx_registry` may be overridden the same way;
`kvx_xfail = {"scenario": "reason"}` on a class marks scenarios expected to fail.
The `kvx_config` default (from `--kvx-config`) and the other defaults live in
`kvx.conformance.pytest_plugin`, which pytest loads through its entry point.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, ClassVar

import pytest

from kvx import Capability, Registry
from kvx.conformance.options import SuiteOptions
from kvx.conformance.pytest_plugin import FIRST_FAILURE_KEY, RESULTS_KEY
from kvx.conformance.runner import (
    FAILED,
    NOT_CLAIMED,
    NOT_RUN,
    connector_claims,
    load_scenarios,
    no_transfer_message,
    run_scenario,
)
from kvx.errors import ConfigError, RegistryError


def claims_of(kv: dict[str, Any], registry: Registry) -> frozenset[Capability]:
    """The connector's claims; a bad config fails the test with the config error's text."""
    try:
        return connector_claims(kv, registry)
    except (ConfigError, RegistryError) as exc:
        problem = str(exc)
    pytest.fail(f"kvx_config {json.dumps(kv)}: {problem}", pytrace=False)


class ConformanceBase:
    """Fixtures every group uses, and the check that the claims leave a KV transfer to test."""

    kvx_xfail: ClassVar[dict[str, str]] = {}

    def run_kvx_scenario(
        self,
        name: str,
        request: pytest.FixtureRequest,
        kvx_config: dict[str, Any],
        kvx_options: SuiteOptions,
        kvx_registry: Registry,
    ) -> None:
        """Run one scenario: skip if not claimed (or, with `kvx_fail_fast`, if a scenario of
        the same config failed already), fail with the scenario's message."""
        reason = self.kvx_xfail.get(name)
        if reason is not None:
            request.node.add_marker(pytest.mark.xfail(reason=reason, strict=True))
        connector = str(kvx_config.get("kv_connector"))
        results = request.config.stash.setdefault(RESULTS_KEY, [])
        first_failures = request.config.stash.setdefault(FIRST_FAILURE_KEY, {})
        config_key = json.dumps(kvx_config, sort_keys=True)
        if config_key in first_failures and request.getfixturevalue("kvx_fail_fast"):
            results.append((connector, name, NOT_RUN))
            pytest.skip(f"not run: --kvx-fail-fast, {first_failures[config_key]} failed first")
        outcome = FAILED  # until the scenario says otherwise (a bad config fails first)
        try:
            claims = claims_of(kvx_config, kvx_registry)
            result = run_scenario(
                load_scenarios()[name], kvx_config, claims, kvx_registry, kvx_options
            )
            outcome = result.outcome
            if result.outcome == NOT_CLAIMED:
                pytest.skip(f"not claimed: {result.message}")
            if result.outcome == FAILED:
                pytest.fail(f"{name}: {result.message}", pytrace=False)
        except pytest.fail.Exception:
            if reason is None:  # an expected failure does not stop the rest
                first_failures.setdefault(config_key, name)
            raise
        finally:
            results.append((connector, name, outcome))

    def test_claims_cover_a_transfer(
        self,
        kvx_config: dict[str, Any],
        kvx_registry: Registry,
        kvx_allow_no_transfer: bool,
    ) -> None:
        """A connector whose claims leave no scenario that moves KV has not been tested."""
        claims = claims_of(kvx_config, kvx_registry)
        transfers = [
            s.name
            for s in load_scenarios().values()
            if s.transfers and not s.missing_claims(claims)
        ]
        if not transfers and not kvx_allow_no_transfer:
            pytest.fail(
                no_transfer_message(str(kvx_config.get("kv_connector")), claims), pytrace=False
            )


def _scenario_test(name: str, summary: str) -> Callable[..., None]:
    def test(
        self: ConformanceBase,
        request: pytest.FixtureRequest,
        kvx_config: dict[str, Any],
        kvx_options: SuiteOptions,
        kvx_registry: Registry,
    ) -> None:
        self.run_kvx_scenario(name, request, kvx_config, kvx_options, kvx_registry)

    test.__name__ = test.__qualname__ = f"test_{name}"
    test.__doc__ = summary
    return test


class PDScenarios(ConformanceBase):
    """Prefill/decode hand-off: P `kv_producer`, D `kv_consumer` (docs/conformance.md)."""


class FaultScenarios(ConformanceBase):
    """Aborts at every stage and killed engines."""


class ContractScenarios(ConformanceBase):
    """Idempotence, shutdown, stats and events, store/reuse, topology and layout claims."""


class RoleScenarios(ConformanceBase):
    """What each `kv_role` obliges and forbids."""


class MLAScenarios(ConformanceBase):
    """An MLA model's latent P/D, between TP sizes, stored and offloaded."""


class MatrixScenarios(ConformanceBase):
    """Every KV dtype, block sizes and prompt lengths up to beyond 64 blocks."""


GROUPS: dict[str, type[ConformanceBase]] = {
    "pd": PDScenarios,
    "faults": FaultScenarios,
    "contract": ContractScenarios,
    "roles": RoleScenarios,
    "mla": MLAScenarios,
    "matrix": MatrixScenarios,
}

for _scenario in load_scenarios().values():
    if _scenario.group not in GROUPS:  # a scenario module added since: its own class
        GROUPS[_scenario.group] = type(
            f"{_scenario.group.title().replace('_', '')}Scenarios",
            (ConformanceBase,),
            {"__module__": __name__, "__doc__": f"Scenarios of scenarios_{_scenario.group}."},
        )
    setattr(
        GROUPS[_scenario.group],
        f"test_{_scenario.name}",
        _scenario_test(_scenario.name, _scenario.summary),
    )


class AllScenarios(
    PDScenarios, FaultScenarios, ContractScenarios, RoleScenarios, MLAScenarios, MatrixScenarios
):
    """Every scenario of the suite."""


for _scenario in load_scenarios().values():  # collected in suite order
    setattr(
        AllScenarios,
        f"test_{_scenario.name}",
        getattr(GROUPS[_scenario.group], f"test_{_scenario.name}"),
    )


__all__ = [
    "AllScenarios",
    "ConformanceBase",
    "ContractScenarios",
    "FaultScenarios",
    "MLAScenarios",
    "MatrixScenarios",
    "PDScenarios",
    "RoleScenarios",
]
