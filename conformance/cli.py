"""`kvx conformance`: the subcommand this package registers through the `kvx_cli_commands` hook."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

import kvx
from kvx.conformance.runner import (
    FAILED,
    PASSED,
    ScenarioResult,
    connector_claims,
    markdown_report,
    run_suite,
)


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="run the conformance suite against a connector"
    )
    parser.add_argument(
        "--kv-transfer-config",
        required=True,
        metavar="JSON|@FILE",
        help="the connector config; '{tmp}' in strings becomes a fresh directory per scenario",
    )
    parser.add_argument("--report", metavar="FILE", help="also write a Markdown report")
    parser.add_argument(
        "--scenario", action="append", metavar="NAME", help="run only this scenario (repeatable)"
    )
    parser.add_argument(
        "--fault-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long fault scenarios wait for the connector to give up",
    )
    return parser


def run(prog: str, argv: list[str]) -> int:
    """Run the suite as `argv` says; 0 when every claimed scenario passed, 1 otherwise."""
    args = _parser(prog).parse_args(argv)
    width = None if sys.stdout.isatty() else 10_000
    out = Console(soft_wrap=True, width=width)
    kv = kvx.load_cli_arg(args.kv_transfer_config)
    if not isinstance(kv, dict):
        problem = f"expected a JSON object, got {type(kv).__name__}"
        raise kvx.ConfigError([kvx.ConfigProblem("--kv-transfer-config", problem)])
    registry = kvx.get_registry()
    claims = connector_claims(kv, registry)
    out.print(
        f"kvx conformance: {kv.get('kv_connector')} claims "
        f"{', '.join(sorted(c.value for c in claims)) or 'nothing'}",
        highlight=False,
    )
    colour = {PASSED: "green", FAILED: "red"}

    def show(result: ScenarioResult) -> None:
        style = colour.get(result.outcome, "yellow")
        detail = f"  {result.message}" if result.message else ""
        out.print(
            f"[{style}]{result.outcome:>11}[/] {result.name} ({result.seconds:.1f}s)"
            f"{escape(detail)}",
            highlight=False,
        )

    try:
        results = run_suite(
            kv,
            only=args.scenario,
            registry=registry,
            fault_timeout_s=args.fault_timeout,
            on_result=show,
        )
    except ValueError as exc:
        raise kvx.ConfigError([kvx.ConfigProblem("--scenario", str(exc))]) from None
    failed = [r for r in results if r.outcome == FAILED]
    passed = sum(r.outcome == PASSED for r in results)
    out.print(
        f"{passed} passed, {len(failed)} failed, {len(results) - passed - len(failed)} not claimed"
    )
    if args.report:
        Path(args.report).write_text(markdown_report(kv, claims, results), encoding="utf-8")
        out.print(f"report written to {args.report}")
    return 1 if failed else 0
