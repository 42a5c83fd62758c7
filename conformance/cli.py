"""`kvx conformance`: the subcommand this package registers through the `kvx_cli_commands` hook,
a thin layer over `run_suite`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

import kvx
from kvx.conformance.options import (
    BLOCK_SIZES,
    DTYPES,
    SuiteOptions,
    block_size,
    dtype_name,
    positive_seconds,
)
from kvx.conformance.runner import (
    FAILED,
    PASSED,
    ScenarioResult,
    connector_claims,
    markdown_report,
    role_note,
    run_suite,
)

COLOUR = {PASSED: "green", FAILED: "red"}
TIMEOUTS = (  # flag, default seconds, meaning
    ("--fault-timeout", 60.0, "how long fault scenarios wait for the connector to give up"),
    (
        "--stall-timeout",
        10.0,
        "fail a P/D run that makes no progress this long, saying what is stuck",
    ),
    (
        "--scenario-timeout",
        None,
        "overall limit of every scenario (default: each scenario's own)",
    ),
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
    for flag, default, meaning in TIMEOUTS:
        parser.add_argument(
            flag, type=positive_seconds, default=default, metavar="SECONDS", help=meaning
        )
    parser.add_argument(
        "--dtype",
        action="append",
        type=dtype_name,
        metavar="DTYPE",
        help=f"narrow the matrix to this KV dtype (repeatable; default: all of {DTYPES})",
    )
    parser.add_argument(
        "--block-size",
        action="append",
        type=block_size,
        metavar="N",
        help=f"narrow the matrix to this block size (repeatable; default: {BLOCK_SIZES})",
    )
    parser.add_argument("--fail-fast", action="store_true", help="stop at the first failure")
    parser.add_argument(
        "--allow-no-transfer",
        action="store_true",
        help="exit 0 even if the connector's claims leave no scenario that moves KV",
    )
    return parser


def run(prog: str, argv: list[str]) -> int:
    """Run the suite as `argv` says. Exit 0 when every claimed scenario passed and some scenario
    moved KV (or `--allow-no-transfer`), 1 otherwise; bad input raises `ConfigError` (exit 2)."""
    args = _parser(prog).parse_args(argv)
    width = None if sys.stdout.isatty() else 10_000
    out = Console(soft_wrap=True, width=width)
    kv = kvx.load_cli_arg(args.kv_transfer_config)
    if not isinstance(kv, dict):
        problem = f"expected a JSON object, got {type(kv).__name__}"
        raise kvx.ConfigError([kvx.ConfigProblem("--kv-transfer-config", problem)])
    options = SuiteOptions(
        args.fault_timeout,
        args.stall_timeout,
        args.scenario_timeout,
        tuple(args.dtype or DTYPES),
        tuple(args.block_size or BLOCK_SIZES),
    )
    registry = kvx.get_registry()
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
        raise kvx.ConfigError([kvx.ConfigProblem("--scenario", str(exc))]) from None
    out.print(escape(suite.summary()), highlight=False)
    if args.report:
        Path(args.report).write_text(markdown_report(kv, suite), encoding="utf-8")
        out.print(f"report written to {args.report}")
    return suite.exit_code(args.allow_no_transfer)
