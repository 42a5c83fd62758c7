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


DTYPES = ("float32", "float16", "bfloat16")
BLOCK_SIZES = (16, 32)


def dtype_name(text: str) -> str:
    """One KV dtype of the matrix (the type of `--dtype`)."""
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a KV dtype; pick one of {DTYPES}")
    return text


def block_size(text: str) -> int:
    """One engine block size of the matrix (the type of `--block-size`): a power of two."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a block size") from None
    if value < 1 or value > 256 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"{value} is not a power of two from 1 to 256")
    return value


@dataclass(frozen=True)
class SuiteOptions:
    """`fault_timeout_s`: how long fault scenarios wait for a connector to give up (leases,
    load timeouts). `stall_timeout_s`: how long a P/D run may go without any progress (no
    output, no change in either engine's blocks) before it fails with a diagnosis.
    `scenario_timeout_s`: overall limit of every scenario (None: each scenario's own).
    `dtypes` / `block_sizes`: the cells the matrix scenarios walk (default: all of them)."""

    fault_timeout_s: float = 60.0
    stall_timeout_s: float = 10.0
    scenario_timeout_s: float | None = None
    dtypes: tuple[str, ...] = DTYPES
    block_sizes: tuple[int, ...] = BLOCK_SIZES

    def __post_init__(self) -> None:
        for name in ("fault_timeout_s", "stall_timeout_s", "scenario_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SuiteOptions.{name} must be a positive number, got {value!r}")
        for field_name, check in (("dtypes", dtype_name), ("block_sizes", block_size)):
            for value in getattr(self, field_name):
                try:
                    check(str(value))
                except argparse.ArgumentTypeError as exc:
                    raise ValueError(f"SuiteOptions.{field_name}: {exc}") from None
        if not self.dtypes or not self.block_sizes:
            raise ValueError("SuiteOptions.dtypes and block_sizes must name at least one each")
