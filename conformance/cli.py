"""`kvx conformance`: run the suite from the command line (a thin layer over `run_suite`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from kvx import get_registry
from kvx.config import load_cli_arg
from kvx.conformance.options import SuiteOptions
from kvx.conformance.runner import (
    FAILED,
    PASSED,
    ScenarioResult,
    connector_claims,
    markdown_report,
    role_note,
    run_suite,
)
from kvx.errors import ConfigError, ConfigProblem

COLOUR = {PASSED: "green", FAILED: "red"}


def run_conformance(args: argparse.Namespace, out: Console) -> int:
    """Exit 0 when every claimed scenario passed and some scenario moved KV (or
    `--allow-no-transfer`), 1 otherwise; bad input raises `ConfigError` (exit 2)."""
    kv = load_cli_arg(args.kv_transfer_config)
    if not isinstance(kv, dict):
        raise ConfigError([ConfigProblem("", f"expected a JSON object, got {type(kv).__name__}")])
    try:
        options = SuiteOptions(args.fault_timeout, args.stall_timeout, args.scenario_timeout)
    except ValueError as exc:
        raise ConfigError([ConfigProblem("--*-timeout", str(exc))]) from None
    registry = get_registry()
    claims = connector_claims(kv, registry)
    out.print(
        f"kvx conformance: {kv.get('kv_connector')} claims "
        f"{', '.join(sorted(c.value for c in claims)) or 'nothing'}",
        highlight=False,
    )
    note = role_note(kv)
    if note:
        out.print(escape(note), highlight=False)

    def show(result: ScenarioResult) -> None:
        style = COLOUR.get(result.outcome, "yellow")
        detail = f"  {result.message}" if result.message else ""
        out.print(
            f"[{style}]{result.outcome:>11}[/] {result.name} ({result.seconds:.1f}s)"
            f"{escape(detail)}",
            highlight=False,
        )

    try:
        suite = run_suite(
            kv,
            only=args.scenario,
            registry=registry,
            options=options,
            fail_fast=args.fail_fast,
            on_result=show,
        )
    except ValueError as exc:
        raise ConfigError([ConfigProblem("--scenario", str(exc))]) from None
    out.print(escape(suite.summary()), highlight=False)
    if args.report:
        Path(args.report).write_text(markdown_report(kv, suite), encoding="utf-8")
        out.print(f"report written to {args.report}")
    return suite.exit_code(args.allow_no_transfer)
