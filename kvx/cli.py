"""The `kvx` command line: `kvx list`, `kvx validate`, `kvx demo`, `kvx proxy`, `kvx --version`,
and the subcommands plugins register through the `kvx_cli_commands` hook (`kvx conformance`).

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
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvx._version import __version__
from kvx.config import KVTransferConfig
from kvx.contract import CONTRACT_VERSION
from kvx.errors import ConfigError, ConfigProblem, MissingDependencyError, RegistryError
from kvx.loading import load_target
from kvx.registry import Registered, Registry, get_registry

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE = 0, 1, 2


def _build_parser(registry: Registry) -> argparse.ArgumentParser:
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

    from kvx.proxy import cli as proxy_cli  # flags only: the proxy extra is imported on start

    p_proxy = sub.add_parser(
        "proxy",
        help="disaggregated-serving proxy in front of prefill and decode servers",
        description="An OpenAI-compatible proxy: each completion is prefilled on a --prefill "
        "server and decoded on a --decode server, which loads the KV cache P computed.",
    )
    proxy_cli.add_arguments(p_proxy)
    p_proxy.set_defaults(func=_cmd_proxy)

    for entry in sorted(registry.commands().values(), key=lambda e: e.name):
        if entry.name in sub.choices:  # kvx's own commands keep their names
            continue
        p_plugin = sub.add_parser(entry.name, help=entry.spec.summary, add_help=False)
        p_plugin.set_defaults(func=None, plugin_command=entry.name)
    return parser


def _status(registry: Registry, kind: str, entry: Registered[Any]) -> str:
    """ "ok" only when the entry's target imports; else what stops it."""
    hint = entry.install_hint()
    if hint is not None:
        return f"missing {', '.join(entry.missing())}: {hint}"
    return registry.import_problem(kind, entry.name) or "ok"


def _cmd_list(args: argparse.Namespace, out: Console, err: Console) -> int:
    registry = get_registry()
    kinds = {
        "connectors": "connector",
        "layouts": "layout",
        "transforms": "transform",
        "storage backends": "storage backend",
    }
    sections = {title: registry.catalogs[kind].entries for title, kind in kinds.items()}
    status = {
        (title, name): _status(registry, kinds[title], entry)
        for title, entries in sections.items()
        for name, entry in entries.items()
    }
    if args.json:
        doc: dict[str, Any] = {
            title: [
                {
                    "name": e.name,
                    "aliases": list(e.spec.aliases),
                    "source": e.source,
                    "plugin": e.plugin,
                    "importable": status[title, e.name] == "ok",
                    "status": status[title, e.name],
                    "install_hint": e.install_hint(),
                    "summary": e.spec.summary,
                }
                for e in entries.values()
            ]
            for title, entries in sections.items()
        }
        doc["plugin_problems"] = [
            {"plugin": p.plugin, "message": p.message} for p in registry.problems
        ]
        out.print_json(json.dumps(doc))
        return EXIT_OK
    for title, entries in sections.items():
        table = Table(title=f"{title} ({len(entries)})", title_justify="left", expand=False)
        for column in ("name", "aliases", "provided by", "status", "summary"):
            table.add_column(column, overflow="fold")
        for e in sorted(entries.values(), key=lambda e: e.name):
            aliases = ", ".join(e.spec.aliases)
            cells = (e.name, aliases, e.source, status[title, e.name], e.spec.summary)
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
    try:
        registry.load_connector_class(entry.name)
    except MissingDependencyError as exc:
        notes.append(f"{exc} to run")
    except RegistryError as exc:
        raise RegistryError(
            f"the config is valid but its connector cannot be used: {exc}"
        ) from None
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


def _run_plugin_command(registry: Registry, name: str, argv: list[str]) -> int:
    """Run a subcommand a plugin registered (`kvx_cli_commands`): its `run(prog, argv)`."""
    entry = registry.catalogs["command"].get(name)
    run_command = load_target(entry.spec.target, what=f"command {name!r} (plugin {entry.plugin!r})")
    if not callable(run_command):
        raise RegistryError(f"command {name!r}: {entry.spec.target} is not callable")
    return int(run_command(f"kvx {name}", argv))


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
    try:
        registry = get_registry()
        parser = _build_parser(registry)
        args, rest = parser.parse_known_args(argv)
        command = getattr(args, "plugin_command", None)
        if command is not None:
            return _run_plugin_command(registry, command, rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
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
