"""The kvx conformance suite: drives a connector through the real request lifecycle on
reference prefill/decode engines and checks every KV byte.

Use it as `kvx conformance --kv-transfer-config '<json>'` or as a pytest plugin:
`pytest -p kvx.conformance --kvx-config '<json>'`.
"""

from importlib.util import find_spec

from kvx.conformance.runner import ScenarioResult, markdown_report, run_suite
from kvx.conformance.scenario import SCENARIOS, Scenario, ScenarioFailure

if find_spec("pytest") is not None:  # `-p kvx.conformance` finds its hooks here
    from kvx.conformance.pytest_plugin import (  # noqa: F401
        pytest_addoption,
        pytest_collection_modifyitems,
    )

__all__ = [
    "SCENARIOS",
    "Scenario",
    "ScenarioFailure",
    "ScenarioResult",
    "markdown_report",
    "run_suite",
]
