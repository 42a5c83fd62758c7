"""The kvx conformance suite: drives a connector through the real request lifecycle on
reference prefill/decode engines and checks every KV byte.

Run it from Python (`run_suite`), as `kvx conformance --kv-transfer-config '<json>'`, inside an
author's own pytest through the kit (`kvx.conformance.kit`), or as
`pytest -p kvx.conformance --kvx-config '<json>'`. See docs/conformance.md.

The names below load on first use: pytest imports this package for its plugin in every session,
which should not cost the engine's imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvx.conformance.options import SuiteOptions
    from kvx.conformance.runner import (
        FAILED,
        NOT_CLAIMED,
        NOT_RUN,
        OUTCOMES,
        PASSED,
        ScenarioResult,
        SuiteResult,
        load_scenarios,
        markdown_report,
        run_suite,
    )
    from kvx.conformance.scenario import SCENARIOS, Scenario, ScenarioFailure

_HOMES = {
    "SuiteOptions": "options",
    **dict.fromkeys(
        (
            "FAILED",
            "NOT_CLAIMED",
            "NOT_RUN",
            "OUTCOMES",
            "PASSED",
            "ScenarioResult",
            "SuiteResult",
            "load_scenarios",
            "markdown_report",
            "run_suite",
        ),
        "runner",
    ),
    **dict.fromkeys(("SCENARIOS", "Scenario", "ScenarioFailure"), "scenario"),
}

# `-p kvx.conformance` registers this package: it brings the plugin module with it (which pytest
# skips when its entry point already loaded it).
pytest_plugins = ["kvx.conformance.pytest_plugin"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvx.conformance' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvx.conformance.{home}"), name)


__all__ = [
    "FAILED",
    "NOT_CLAIMED",
    "NOT_RUN",
    "OUTCOMES",
    "PASSED",
    "SCENARIOS",
    "Scenario",
    "ScenarioFailure",
    "ScenarioResult",
    "SuiteOptions",
    "SuiteResult",
    "load_scenarios",
    "markdown_report",
    "run_suite",
]
