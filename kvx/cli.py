"""The `kvx` command line: `kvx list`, `kvx validate`, `kvx proxy`, `kvx --version`.

Exit codes: 0 success, 2 bad input (invalid config, bad arguments), 1 an internal error (set
`KVX_DEBUG=1` for its traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from kvx._version import __version__
from kvx.config import KVTransferConfig, load_cli_arg
from kvx.contract import CONTRACT_VERSION
from kvx.errors import ConfigError, ConfigProblem, RegistryError
from kvx.registry import Registered, Registry, get_registry

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE = 0, 1, 2


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvx",
        description="kvx: pluggable KV-cache transfer SDK for LLM serving.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"kvx {__version__} (connector contract {'.'.join(map(str, CONTRACT_VERSION))})",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p_list = sub.add_parser("list", help="list connectors, layouts, transforms, storage backends")
    p_list.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p_list.set_defaults(func=_cmd_list)

    p_val = sub.add_parser(
        "validate", help="validate a --kv-transfer-config and print it normalised"
    )
    p_val.add_argument(
        "--kv-transfer-config",
        required=True,
        metavar="JSON|@FILE",
        help="the config as a JSON object, or @path to a JSON file",
    )
    p_val.set_defaults(func=_cmd_validate)

    p_demo = sub.add_parser("demo", help="run prefill and decode engines with a connector")
    p_demo.add_argument(
        "--kv-transfer-config",
        metavar="JSON|@FILE",
        help="connector config (default: the embedded shared-storage setup)",
    )
    p_demo.add_argument(
        "--tp",
        default="1:1",
        metavar="P:D",
        help="tensor-parallel sizes of prefill and decode (default 1:1)",
    )
    p_demo.add_argument("--prompts", type=int, default=7, help="number of prompts")
    p_demo.add_argument("--max-tokens", type=int, default=8, help="tokens to generate each")
    p_demo.add_argument("--layout", default="NHD", help="KV layout of both engines")
    p_demo.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p_demo.add_argument("--seed", type=int, default=0, help="prompt and model seed")
    p_demo.set_defaults(func=_cmd_demo)

    p_conf = sub.add_parser("conformance", help="run the conformance suite against a connector")
    p_conf.add_argument(
        "--kv-transfer-config",
        required=True,
        metavar="JSON|@FILE",
        help="the connector config; '{tmp}' in strings becomes a fresh directory per scenario",
    )
    p_conf.add_argument("--report", metavar="FILE", help="also write a Markdown report")
    p_conf.add_argument(
        "--scenario", action="append", metavar="NAME", help="run only this scenario (repeatable)"
    )
    p_conf.add_argument(
        "--fault-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long fault scenarios wait for the connector to give up",
    )
    p_conf.set_defaults(func=_cmd_conformance)

    from kvx.proxy import cli as proxy_cli  # flags only: the proxy extra is imported on start

    p_proxy = sub.add_parser(
        "proxy",
        help="disaggregated-serving proxy in front of prefill and decode servers",
        description="An OpenAI-compatible proxy: each completion is prefilled on a --prefill "
        "server and decoded on a --decode server, which loads the KV cache P computed.",
    )
    proxy_cli.add_arguments(p_proxy)
    p_proxy.set_defaults(func=_cmd_proxy)
    return parser


def _status(entry: Registered[Any]) -> str:
    hint = entry.install_hint()
    return "ok" if hint is None else f"missing {', '.join(entry.missing())}: {hint}"


def _cmd_list(args: argparse.Namespace, out: Console, err: Console) -> int:
    registry = get_registry()
    sections: dict[str, dict[str, Registered[Any]]] = {
        "connectors": registry.connectors(),
        "layouts": registry.layouts(),
        "transforms": registry.transforms(),
        "storage backends": registry.storage_backends(),
    }
    if args.json:
        doc: dict[str, Any] = {
            kind: [
                {
                    "name": e.name,
                    "aliases": list(e.spec.aliases),
                    "source": e.source,
                    "plugin": e.plugin,
                    "importable": not e.missing(),
                    "install_hint": e.install_hint(),
                    "summary": e.spec.summary,
                }
                for e in entries.values()
            ]
            for kind, entries in sections.items()
        }
        doc["plugin_problems"] = [
            {"plugin": p.plugin, "message": p.message} for p in registry.problems
        ]
        out.print_json(json.dumps(doc))
        return EXIT_OK
    for kind, entries in sections.items():
        table = Table(title=f"{kind} ({len(entries)})", title_justify="left", expand=False)
        for column in ("name", "aliases", "provided by", "status", "summary"):
            table.add_column(column, overflow="fold")
        for e in sorted(entries.values(), key=lambda e: e.name):
            cells = (e.name, ", ".join(e.spec.aliases), e.source, _status(e), e.spec.summary)
            table.add_row(*(Text(cell) for cell in cells))
        out.print(table)
    for problem in registry.problems:
        err.print(
            f"[yellow]warning:[/] plugin {problem.plugin!r} not loaded: {problem.message}",
            highlight=False,
        )
    return EXIT_OK


def _cmd_validate(args: argparse.Namespace, out: Console, err: Console) -> int:
    registry = get_registry()
    try:
        config = KVTransferConfig.from_cli(args.kv_transfer_config, registry=registry)
    except ConfigError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        return EXIT_USAGE
    for note in _validate_notes(config, registry):
        err.print(f"note: {note}", markup=False, highlight=False)
    out.print_json(config.to_json())
    return EXIT_OK


def _validate_notes(config: KVTransferConfig, registry: Registry) -> list[str]:
    """What the operator should know about a valid config (missing extras, unchecked keys)."""
    notes = []
    if config.kv_connector is None:
        return ["no kv_connector is set: KV transfer is disabled"]
    if config.kv_connector_module_path:
        target = registry.extra_config_target(config.kv_connector, config.kv_connector_module_path)
        if target.unchecked and config.kv_connector_extra_config:
            notes.append(
                f"{config.kv_connector} declares no extra_config_schema; its "
                "kv_connector_extra_config was not validated"
            )
        return notes
    entry = registry.connector(config.kv_connector)
    hint = entry.install_hint()
    if hint:
        notes.append(f"connector {entry.name!r} needs {', '.join(entry.missing())} to run: {hint}")
    return notes


def _cmd_demo(args: argparse.Namespace, out: Console, err: Console) -> int:
    from kvx.demo import DemoOptions, run_demo

    for name in ("prompts", "max_tokens", "block_size"):
        if getattr(args, name) < 1:
            raise ConfigError(
                [
                    ConfigProblem(
                        f"--{name.replace('_', '-')}",
                        f"{getattr(args, name)} is not a positive integer",
                    )
                ]
            )
    options = DemoOptions(
        args.kv_transfer_config,
        args.tp,
        args.prompts,
        args.max_tokens,
        args.layout,
        args.block_size,
        args.seed,
    )
    return run_demo(options, get_registry(), out)


def _cmd_conformance(args: argparse.Namespace, out: Console, err: Console) -> int:
    from kvx.conformance.runner import (
        FAILED,
        PASSED,
        ScenarioResult,
        connector_claims,
        markdown_report,
        run_suite,
    )

    kv = load_cli_arg(args.kv_transfer_config)
    if not isinstance(kv, dict):
        raise ConfigError([ConfigProblem("", f"expected a JSON object, got {type(kv).__name__}")])
    registry = get_registry()
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
        raise ConfigError([ConfigProblem("--scenario", str(exc))]) from None
    failed = [r for r in results if r.outcome == FAILED]
    passed = sum(r.outcome == PASSED for r in results)
    out.print(
        f"{passed} passed, {len(failed)} failed, {len(results) - passed - len(failed)} not claimed"
    )
    if args.report:
        Path(args.report).write_text(markdown_report(kv, claims, results), encoding="utf-8")
        out.print(f"report written to {args.report}")
    return 1 if failed else 0


def _cmd_proxy(args: argparse.Namespace, out: Console, err: Console) -> int:
    from kvx.proxy import cli as proxy_cli

    config = proxy_cli.config_from_args(args)
    missing = proxy_cli.missing_extra()
    if missing:
        err.print(
            f"error: kvx proxy needs the 'proxy' extra ({', '.join(missing)} not installed): "
            "pip install 'kvx[proxy]'",
            markup=False,
            highlight=False,
        )
        return EXIT_INTERNAL
    return proxy_cli.run(config, out)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvx` command; returns the exit code."""
    # Piped output gets a wide fixed width so tables are not folded into unreadable columns.
    width = None if sys.stdout.isatty() else 10_000
    out = Console(soft_wrap=True, width=width)
    err = Console(stderr=True, soft_wrap=True, width=width)
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        return int(args.func(args, out, err))
    except SystemExit as exc:  # argparse: --help / --version (0) or usage errors (2)
        return int(exc.code or 0) if isinstance(exc.code, int) else EXIT_USAGE
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except (RegistryError, ConfigError) as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        return EXIT_USAGE
    except Exception as exc:
        if os.environ.get("KVX_DEBUG"):
            traceback.print_exc()
        err.print(
            f"internal error: {type(exc).__name__}: {exc} (set KVX_DEBUG=1 for the "
            "traceback and please report it)",
            markup=False,
            highlight=False,
        )
        return EXIT_INTERNAL


def run() -> None:
    """Console-script wrapper: exit with `main()`'s code."""
    sys.exit(main())
