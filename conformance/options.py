"""How a conformance run is bounded and judged (shared by the Python API, the CLI and pytest)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


def positive_seconds(text: str) -> float:
    """A positive number of seconds (the type of the timeout options of the CLI and pytest)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


@dataclass(frozen=True)
class SuiteOptions:
    """`fault_timeout_s`: how long fault scenarios wait for a connector to give up (leases,
    load timeouts). `stall_timeout_s`: how long a P/D run may go without any progress (no
    output, no change in either engine's blocks) before it fails with a diagnosis.
    `scenario_timeout_s`: overall limit of every scenario (None: each scenario's own)."""

    fault_timeout_s: float = 60.0
    stall_timeout_s: float = 10.0
    scenario_timeout_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("fault_timeout_s", "stall_timeout_s", "scenario_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SuiteOptions.{name} must be a positive number, got {value!r}")
