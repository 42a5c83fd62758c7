"""Registers `kvx conformance` (kvx's core CLI does not import this package)."""

from __future__ import annotations

import kvx

kvx_cli_commands = kvx.provides(
    kvx.CommandSpec(
        "conformance",
        "kvx.conformance.cli:run",
        summary="run the conformance suite against a connector",
    )
)
